"""The runner of the benchmark scripts (benchmarks/*.py): a script states its cases and its arms.

A `Benchmark` names its cases (each a `Case`: an id and the columns it fills) and either
- `trial`: per case, the arms to time (a `Trial`), and `rows`: the CSV rows of the case's
  `Timings`. The arms are timed by the harness's one timer (measure.time_interleaved: warm-up
  rounds, then the arms alternated within each round, the order reversed every round, so that
  no arm always runs first), the same loop `zorro bench` times its cases with; or
- `compute`: per case, its rows (a benchmark that counts costs rather than time, or one that
  times inside processes of its own with `time_arms`).
`main(bench)` owns the rest: the arguments (`--out`, `--rounds`/`--repeats`, `--warmup`, `--quick`,
`--cases`, `--list` and the script's own), the case loop, a failure row for a case that raises (its
status and reason; the rows of the cases before it stay), and the CSV, rewritten whole after every
case through a temporary file and a rename, never through a symbolic link (files.py).
Every row gets the trailing columns `status` ("ok", or "error" with the reason in `error`).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from zorro_harness.bench.files import refuse_link, replace_atomically
from zorro_harness.bench.measure import Speedup, Stats, speedup, summarize, time_interleaved, time_once
from zorro_harness.bench.results import TableOut, csv_line

STATUS_COLUMNS = ("status", "error")
"""Appended to every row: "ok" and "", or "error" and why the case failed."""


@dataclass(frozen=True)
class Case:
    """One case of a benchmark script."""

    id: str
    """What --cases selects and a failure row names."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The case's columns: its rows and its failure row carry them."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """What the script runs the case with, beyond its columns (not written)."""

    def __getitem__(self, key: str) -> Any:
        return self.params[key] if key in self.params else self.fields[key]


@dataclass(frozen=True)
class Trial:
    """What a timed case hands the runner: its arms (callables), timed interleaved."""

    arms: Mapping[str, Callable[[], object]]
    between: Optional[Callable[[], None]] = None
    """Runs before every call, outside the clock (zeroing gradients)."""
    device: str = "cpu"
    """Synchronized before every clock read."""
    clock: Callable[[Callable[[], object], Any], float] = time_once
    """measure.time_once, or measure.self_timed for arms that return their own seconds."""
    ideal: Optional[float] = None
    """The cost model's ideal speedup of the case, where the benchmark has one."""
    notes: Mapping[str, Any] = field(default_factory=dict)
    """What the arms record while they run (tokens, plans) and the rows read back."""


@dataclass(frozen=True)
class Timings:
    """Each arm's milliseconds, one per round (round i of every arm comes from the same round)."""

    samples: Mapping[str, list[float]]
    ideal: Optional[float] = None
    notes: Mapping[str, Any] = field(default_factory=dict)
    """The trial's notes."""

    def stats(self, arm: str) -> Stats:
        """Median, p20, p80 of the arm (milliseconds)."""
        return summarize(self.samples[arm])

    def median_ms(self, arm: str) -> float:
        return self.stats(arm).p50

    def seconds(self, arm: str) -> list[float]:
        return [ms / 1e3 for ms in self.samples[arm]]

    def speedup(self, baseline: str, other: str) -> Speedup:
        """baseline / other from the paired rounds (median of the ratios, p20, p80, error)."""
        return speedup(self.samples[baseline], self.samples[other])

    def ratios(self, baseline: str, other: str) -> list[float]:
        return [b / o for b, o in zip(self.samples[baseline], self.samples[other])]


def time_arms(
    arms: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int,
    between: Optional[Callable[[], None]] = None,
    device: str = "cpu",
    clock: Callable[[Callable[[], object], Any], float] = time_once,
    ideal: Optional[float] = None,
) -> Timings:
    """The arms timed by measure.time_interleaved; also what a script calls inside its own ranks."""
    return Timings(time_interleaved(arms, device, warmup, rounds, between, clock), ideal)


def _no_rows(case: Case, timings: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    raise TypeError("a Benchmark with a trial needs rows")


@dataclass(frozen=True)
class Benchmark:
    """A benchmark script: its cases and arms; main() runs it."""

    name: str
    doc: str
    """The script's docstring: --help prints it."""
    cases: Callable[[argparse.Namespace], Sequence[Case]]
    arms: tuple[str, ...] = ("baseline", "dedup")
    trial: Optional[Callable[[Any, Case, argparse.Namespace], Trial]] = None
    rows: Callable[[Case, Timings, argparse.Namespace], list[dict[str, Any]]] = _no_rows
    compute: Optional[Callable[[Any, Case, argparse.Namespace], list[dict[str, Any]]]] = None
    setup: Optional[Callable[[argparse.Namespace, Sequence[Case]], Any]] = None
    """Built once before the cases (a model, engines); its result is every trial's first argument.
    A raise there fails every case (each one a failure row)."""
    teardown: Optional[Callable[[Any], None]] = None
    arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
    """Adds the script's own arguments (sizes, presets)."""
    quick: Mapping[str, Any] = field(default_factory=dict)
    """--quick: these argument values (a tiny size), where the command line does not give one."""
    warmup: int = 1
    rounds: int = 5
    out: Optional[str] = None
    """The default --out (None: print only)."""
    columns: tuple[str, ...] = ()
    """The CSV's columns, in order (empty: the rows' keys as they come)."""
    meta: Optional[Callable[[argparse.Namespace], dict[str, Any]]] = None
    """Columns after `columns` with the same value in every row (versions, host, time)."""
    report: Optional[Callable[[list[dict[str, Any]], argparse.Namespace], None]] = None
    """Prints the summary of the ok rows (default: each row as key=value)."""

    def __post_init__(self) -> None:
        if (self.trial is None) == (self.compute is None):
            raise ValueError(f"benchmark {self.name}: give exactly one of trial (timed arms) and compute (rows)")


def parser(bench: Benchmark) -> argparse.ArgumentParser:
    """The shared front of every benchmark script, then the script's own arguments."""
    ap = argparse.ArgumentParser(
        prog=f"benchmarks/{bench.name}.py", description=bench.doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=bench.out, help=f"the CSV to write (default: {bench.out or 'none, print only'})")
    ap.add_argument(
        "--rounds", "--repeats", dest="rounds", type=int, default=bench.rounds, help="timed rounds, arms alternated"
    )
    ap.add_argument("--warmup", type=int, default=bench.warmup, help="untimed rounds first")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a tiny size: checks the script runs, figures mean nothing (writes only an --out given with it)",
    )
    ap.add_argument("--cases", default=None, help="comma-separated globs or substrings of case ids to run")
    ap.add_argument("--list", action="store_true", help="print the case ids and exit")
    if bench.arguments is not None:
        bench.arguments(ap)
    return ap


def parse_args(bench: Benchmark, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = parser(bench)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        ap.error(f"need --rounds >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")
    if args.quick:
        if args.out == bench.out:  # a tiny run never replaces the committed results file
            args.out = None
        for key, value in bench.quick.items():
            if getattr(args, key) == ap.get_default(key):  # a value given on the command line wins
                setattr(args, key, value)
    return args


def select(cases: Sequence[Case], patterns: Optional[str]) -> list[Case]:
    """The cases whose id matches one of the comma-separated globs or substrings (all: None)."""
    if not patterns:
        return list(cases)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.id, p) or p in c.id for p in pats)]


def failure_row(case: Case, error: BaseException) -> dict[str, Any]:
    """The row of a case that raised: its columns, status "error" and the reason in one line."""
    text = str(error).strip()
    reason = f"{type(error).__name__}: {text.splitlines()[-1] if text else ''}".strip()
    return {**case.fields, "status": "error", "error": reason[:500]}


def columns_of(bench: Benchmark, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> list[str]:
    """The CSV header: the benchmark's columns (or the rows' keys), the meta columns, status, error."""
    cols = list(bench.columns)
    if not cols:
        for r in rows:
            cols += [k for k in r if k not in cols and k not in meta and k not in STATUS_COLUMNS]
    return cols + [k for k in meta if k not in cols] + list(STATUS_COLUMNS)


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
    """Write `rows` to `path` whole (a temporary file renamed over it); a link at `path` is refused."""
    path = Path(path)
    refuse_link(path, "--out")
    if path.is_dir():
        raise ValueError(f"--out {path} is a directory; give a CSV file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    unknown = sorted({k for r in rows for k in r} - set(columns))
    if unknown:
        raise ValueError(f"rows hold columns the header lacks: {unknown}")
    # The results files' one line writer: formula-like cells quoted for spreadsheets, one line per row.
    data = csv_line(list(columns)) + b"".join(csv_line([r.get(c, "") for c in columns]) for r in rows)
    replace_atomically(path, lambda f: f.write(data))


def run_case(bench: Benchmark, context: Any, case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of one case (raises when the case fails)."""
    if bench.compute is not None:
        return bench.compute(context, case, args)
    assert bench.trial is not None
    trial = bench.trial(context, case, args)
    timings = time_arms(trial.arms, args.rounds, args.warmup, trial.between, trial.device, trial.clock, trial.ideal)
    return bench.rows(case, Timings(timings.samples, timings.ideal, trial.notes), args)


def _print_rows(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items() if k not in STATUS_COLUMNS))


def main(bench: Benchmark, argv: Optional[Sequence[str]] = None) -> int:
    """Run the script: every selected case, its rows (or its failure row) to the CSV as it finishes.
    Exit status 1 when a case failed, 0 otherwise."""
    args = parse_args(bench, argv)
    cases = select(bench.cases(args), args.cases)
    if args.list:
        print("\n".join(c.id for c in cases))
        return 0
    if not cases:
        print(f"no case matches --cases {args.cases}", file=sys.stderr)
        return 2
    out: Optional[TableOut] = None
    if args.out:
        # every output checked before anything is measured; a sweep's file or another script's refused
        out = TableOut(args.out, "--out", f"benchmarks/{bench.name}.py", (*bench.columns, *STATUS_COLUMNS))
        try:
            out.check()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    rows: list[dict[str, Any]] = []
    old_term = signal.signal(signal.SIGTERM, _terminated)
    try:
        with out if out is not None else contextlib.nullcontext():
            failed = _run_cases(bench, cases, args, out, rows)
    except KeyboardInterrupt as e:
        name = "SIGTERM" if isinstance(e, _Terminated) else "SIGINT"
        kept = f"the {len(rows)} row(s) finished are kept in {args.out}" if out is not None and rows else "nothing kept"
        print(f"interrupted by {name}: {kept}", file=sys.stderr)
        return 128 + (signal.SIGTERM if name == "SIGTERM" else signal.SIGINT)
    except (ValueError, OSError) as e:  # the file is busy (a sweep writes it), or cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, old_term)
    ok = [r for r in rows if r["status"] == "ok"]
    (bench.report or _print_rows)(ok, args)
    if args.out:
        kept = f"; the old one is now {out.kept}" if out is not None and out.kept else ""
        print(f"wrote {args.out} ({len(rows)} rows{kept})", file=sys.stderr)
    return 1 if failed else 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, stopping the script as Ctrl-C does (the finished rows are on disk already)."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def _run_cases(
    bench: Benchmark, cases: list[Case], args: argparse.Namespace, out: Optional[TableOut], rows: list
) -> int:
    """Every case, its rows appended to `rows` and the CSV rewritten after each; the failed count."""
    failed = 0
    context, setup_error = None, None
    try:
        context = bench.setup(args, cases) if bench.setup is not None else None
    except Exception as e:  # noqa: BLE001 -- every case becomes a failure row that says why
        setup_error = e
    meta: dict[str, Any] = {}
    if bench.meta is not None and setup_error is None:
        try:
            meta = bench.meta(args)
        except Exception as e:  # noqa: BLE001 -- as a failed setup
            setup_error = e
    try:
        for case in cases:
            t0 = time.perf_counter()
            try:
                if setup_error is not None:
                    raise setup_error
                new = [{**r, "status": "ok", "error": ""} for r in run_case(bench, context, case, args)]
            except Exception as e:  # noqa: BLE001 -- a failed case is a row, the next case runs
                new = [failure_row(case, e)]
                failed += 1
                print(f"{case.id}: {new[0]['error']}", file=sys.stderr, flush=True)
            else:
                print(f"{case.id}: ok ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            rows += [{**r, **meta} for r in new]
            if out is not None:
                columns = columns_of(bench, rows, meta)
                unknown = sorted({k for r in rows for k in r} - set(columns))
                if unknown:
                    raise ValueError(f"rows hold columns the header lacks: {unknown}")
                out.write(rows, columns)
    finally:
        if bench.teardown is not None and context is not None:
            bench.teardown(context)
    return failed


# ---------------------------------------------------------------- the paired (long) CSV format

PAIRED_COLUMNS = ("kind", "phase", "arm", "value", "p20", "p80", "n")
"""The rows of benchmarks/verl_engine.py, verl_ulysses.py and openrlhf_actor.py, in seconds:
`sample` (every round of each arm), `median_s` (median, p20, p80 of each arm), `speedup` (ratio
of the medians, with the p20-p80 of the paired ratios), `ideal` (the cost model's) and
`efficiency` (speedup / ideal)."""


def paired_rows(
    phase: str, timings: Timings, baseline: str, other: str, efficiency: bool = True
) -> list[dict[str, Any]]:
    """The paired format's rows of one phase, `other` against `baseline`."""
    b, o = timings.seconds(baseline), timings.seconds(other)
    rows: list[dict[str, Any]] = []
    for i, (tb, to) in enumerate(zip(b, o)):
        rows.append(dict(kind="sample", phase=phase, arm=baseline, value=f"{tb:.4f}", p20="", p80="", n=i))
        rows.append(dict(kind="sample", phase=phase, arm=other, value=f"{to:.4f}", p20="", p80="", n=i))
    for arm, xs in ((baseline, b), (other, o)):
        s = summarize(xs)
        rows.append(
            dict(
                kind="median_s",
                phase=phase,
                arm=arm,
                value=f"{s.p50:.4f}",
                p20=f"{s.p20:.4f}",
                p80=f"{s.p80:.4f}",
                n=s.n,
            )
        )
    ratio = summarize(timings.ratios(baseline, other))
    value = summarize(b).p50 / summarize(o).p50
    rows.append(
        dict(
            kind="speedup",
            phase=phase,
            arm=f"{other}/{baseline}",
            value=f"{value:.3f}",
            p20=f"{ratio.p20:.3f}",
            p80=f"{ratio.p80:.3f}",
            n=ratio.n,
        )
    )
    if timings.ideal is not None:
        rows.append(
            dict(kind="ideal", phase=phase, arm="cost model", value=f"{timings.ideal:.3f}", p20="", p80="", n="")
        )
        if efficiency:
            eff = value / timings.ideal
            rows.append(
                dict(kind="efficiency", phase=phase, arm="speedup/ideal", value=f"{eff:.3f}", p20="", p80="", n="")
            )
    return rows


def paired_report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """One line per phase of paired rows: each arm's median [p20, p80], the speedup, the ideal."""
    for phase in dict.fromkeys(r["phase"] for r in rows):
        mine = [r for r in rows if r["phase"] == phase]
        arms = [
            f"{r['arm']} {float(r['value']):.3f} s [{r['p20']}, {r['p80']}]" for r in mine if r["kind"] == "median_s"
        ]
        line = f"{phase}: " + ", ".join(arms)
        for r in mine:
            if r["kind"] == "speedup":
                line += f"; speedup {float(r['value']):.2f}x (pairs p20-p80 {r['p20']}-{r['p80']})"
            elif r["kind"] in ("ideal", "efficiency"):
                line += f", {r['kind']} {float(r['value']):.2f}"
        print(line)
