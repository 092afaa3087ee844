"""`zorro bench sweep SUITE` and `zorro bench run`: time the deduplicated actor against the baseline.
The sweep itself is zorro_harness.bench.sweep; this module parses arguments and prints."""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zorro_cli import bench_memory
from zorro_cli.choices import Attn, Baseline, DType, LogitsMode, Phase, Sharing
from zorro_cli.console import console, escape, fail, resolve_device, warn
from zorro_cli.signals import Interrupted, stopped_by_signals
from zorro_core.plan.dtypes import DTYPES
from zorro_core.plan.trie import DEFAULT_MIN_SHARED_TOKENS
from zorro_harness.bench.guard import ranks_too_many
from zorro_harness.bench.inputs import model_config
from zorro_harness.bench.measure import LARGE, format_speedup
from zorro_harness.bench.results import check_out, sidecar_path
from zorro_harness.bench.runner import ARMS, case_rows, refused_arms
from zorro_harness.bench.suite import CASE_ACTOR, Case, Measure, Suite, load_suite
from zorro_harness.bench.sweep import FAILED, run_suite, unresolved_models

MAX_MEMORY_HELP = (
    "Memory a case may take, as 16GiB (default: what the machine has available). A case estimated "
    "past it is refused before running, a case process that grows past it is stopped: status=oom."
)
bench_app = typer.Typer(help="Time the deduplicated actor against the packed baseline.", no_args_is_help=True)


def _cell(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    v = row.get(key)
    if v in (None, ""):
        return "-"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f"{x:.3g}" if math.isfinite(x) and abs(x) >= LARGE else fmt.format(x)


def _speedup(row: dict) -> str:
    if row.get("speedup") in (None, ""):
        return "-"
    return format_speedup(float(row["speedup"]), float(row.get("speedup_err") or "nan"))


def _short_ids(ids: list[str]) -> tuple[list[str], str]:
    """Case ids without the parts every id shares (those go to the caption)."""
    split = [i.split(":") for i in ids]
    if len(split) < 2 or len({len(s) for s in split}) != 1:
        return ids, ""
    same = [all(s[k] == split[0][k] for s in split) for k in range(len(split[0]))]
    if all(same):
        return ids, ""
    short = [":".join(p for p, s in zip(parts, same) if not s) for parts in split]
    return short, ":".join(p for p, s in zip(split[0], same) if s)


def results_table(rows: list[dict], title: str) -> Table:
    labels, common = _short_ids([r["case_id"] for r in rows])
    t = Table(title=title, caption=escape(f"all cases: {common}") if common else None)
    for col, just in [
        ("case", "left"),
        ("phase", "left"),
        ("baseline ms", "right"),
        ("dedup ms", "right"),
        ("speedup", "right"),
        ("ideal", "right"),
        ("eff.", "right"),
        ("peak MiB b/d", "right"),
        ("status", "left"),
    ]:
        t.add_column(col, justify=just)
    for label, r in zip(labels, rows):
        status = (
            r["status"] if r["status"] == "ok" else f"[red]{r['status']}[/]: {escape(str(r.get('error', ''))[:60])}"
        )
        mem = f"{_cell(r, 'baseline_peak_mem_mib', '{:.0f}')}/{_cell(r, 'dedup_peak_mem_mib', '{:.0f}')}"
        phase = r["phase"].replace("forward_backward", "fwd+bwd")
        t.add_row(
            escape(label),
            phase,
            _cell(r, "baseline_ms_p50"),
            _cell(r, "dedup_ms_p50"),
            _speedup(r),
            _cell(r, "ideal_speedup"),
            _cell(r, "efficiency"),
            mem,
            status,
        )
    return t


_UNITS = {"": None, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def parse_size(text: Optional[str]) -> Optional[int]:
    """'512MiB', '4G', '1.5GiB' -> bytes (K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None or float(m.group(1)) <= 0:
        fail(f"--max-memory {text!r}: give a size > 0 with a unit, as 512MiB, 4GiB or 16G")
    return int(float(m.group(1)) * unit)


def _sweep(suite: Suite, out: Path, mode: str, max_memory: Optional[int]) -> list[dict]:
    """run_suite with a progress bar and a line per row."""
    try:  # refused before the progress bar starts: the refusal is the one line printed
        check_out(out, mode, protect=(suite.source,) if suite.source else ())
    except ValueError as e:
        fail(str(e))
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[case]}"),
        console=console,
        transient=False,
    )
    task = progress.add_task(escape(suite.name), total=None, case="")

    def on_case(case: Case, i: int, n: int) -> None:
        progress.update(task, total=n, completed=i, case=escape(case.case_id))

    def on_row(row: dict) -> None:
        progress.console.print(
            f"  {escape(row['case_id'])} {row['phase']}: {_speedup(row)} (ideal {row.get('ideal_speedup', '-')}) "
            f"{escape(str(row['status']))}"
        )

    written = []
    try:
        with stopped_by_signals(), progress:
            try:
                rows = run_suite(
                    suite,
                    out,
                    mode=mode,
                    notify=warn,
                    on_case=on_case,
                    on_row=lambda row: (written.append(row), on_row(row)),
                    max_memory=max_memory,
                )
            except ValueError as e:  # the results file is locked by another sweep, damaged, or not ours
                fail(str(e))
            progress.update(task, completed=progress.tasks[0].total or 0)
    except Interrupted as e:
        again = f"zorro bench sweep {suite.source} --out {out} --resume" if suite.source else f"--out {out} --resume"
        fail(
            f"interrupted by {e.signal.name}: {len(written)} row(s) written by this run are kept in {out} (every "
            f"finished row is); `{again}` runs the rest",
            code=128 + e.signal,
        )
    return rows


def _finish(rows: list[dict], out: Optional[Path], title: str) -> None:
    if rows:
        console.print(results_table(rows, title))
    failed = [r for r in rows if r["status"] in FAILED]
    if out is not None:
        console.print(f"rows appended to [bold]{escape(str(out))}[/], environment in {escape(str(sidecar_path(out)))}")
    if failed:
        console.print(
            f"[red]{len(failed)} row(s) failed[/] (status {', '.join(sorted({r['status'] for r in failed}))})"
        )
        raise typer.Exit(1)


@bench_app.command("sweep")
def sweep(
    suite_file: Path = typer.Argument(..., help="Suite TOML (see suites/)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="CSV to write (default results/<suite>.csv)."),
    resume: bool = typer.Option(False, "--resume", help="Keep the CSV and skip every case+phase already done."),
    filters: list[str] = typer.Option(
        [],
        "--filter",
        "-k",
        help="Only cases matching: key=value (glob) on a case field or actor.<option> (actor.logits_mode=memory), "
        "else a substring/glob of the case id. Repeatable (all must match).",
    ),
    device: Optional[str] = typer.Option(
        None, "--device", help="Run every case on this device (cpu or cuda) instead of the suite's."
    ),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Override the suite's timed repeats."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Override the suite's warmup rounds."),
    memory: Optional[bool] = typer.Option(
        None, "--memory/--no-memory", help="Override the suite's peak-memory setting."
    ),
    list_only: bool = typer.Option(False, "--list", help="Print the cases and exit."),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
) -> None:
    """Run every case of a suite, each in its own process, appending one row per case and phase."""
    if device:
        resolve_device(device)  # asked for explicitly: a device that is not here is an error, not skipped rows
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", DeprecationWarning)
            suite = load_suite(suite_file)
            if device:
                suite = suite.on_device(device)
            suite = suite.filtered(filters)
        for note in dict.fromkeys(str(n.message) for n in notes if issubclass(n.category, DeprecationWarning)):
            warn(f"{suite_file}: {note}" if note.startswith("[") else note)
        overrides = {k: v for k, v in (("repeats", repeats), ("warmup", warmup), ("memory", memory)) if v is not None}
        if overrides:
            suite.measure = Measure(**{**dataclasses.asdict(suite.measure), **overrides})
    except ValueError as e:
        fail(str(e))
    if list_only:
        for c in suite.cases:
            typer.echo(c.case_id)
        return
    if not suite.cases:
        fail("no case matches the filters")
    unknown = unresolved_models(suite.cases)
    if unknown:
        fail(f"{suite_file}: " + "; ".join(unknown.values()))
    out = out or Path("results") / f"{suite.name}.csv"
    rows = _sweep(suite, out, mode="resume" if resume else "replace", max_memory=parse_size(max_memory))
    _finish(rows, out, f"zorro bench sweep {suite.name}")


@bench_app.command("run")
def run(
    model: str = typer.Option(
        "small-qwen3", "--model", help="Preset, local checkpoint, or a model in the local HF cache."
    ),
    attn: Attn = typer.Option(
        Attn("sdpa"),
        "--attn-implementation",
        "--attn",
        help="actor.attn_implementation of both arms (flex_attention needs --no-use-split-attention; auto: zorro "
        "picks). --attn: the older name.",
    ),
    split: bool = typer.Option(
        True,
        "--use-split-attention/--no-use-split-attention",
        "--split/--mask",
        help="actor.use_split_attention of the dedup arm: two varlen calls, or one masked call over the packed "
        "row. --split/--mask: the older names.",
    ),
    logits_mode: LogitsMode = typer.Option(
        LogitsMode("compute"), "--logits-mode", help="actor.logits_mode: how log-probs are computed (both arms)."
    ),
    logits_memory_budget_mib: Optional[float] = typer.Option(
        None,
        "--logits-memory-budget-mib",
        help="actor.logits_memory_budget_mib: logits_mode memory's MiB per chunk (default: the actor's).",
    ),
    sharing: Sharing = typer.Option(
        Sharing("prompt"),
        "--sharing",
        help="actor.sharing of the dedup arm: prompt (identical prompts) or prefix (a token trie over whole rows).",
    ),
    min_shared_tokens: int = typer.Option(
        DEFAULT_MIN_SHARED_TOKENS,
        "--min-shared-tokens",
        help="actor.min_shared_tokens: with --sharing prefix, the shortest shared run split off as a node.",
    ),
    dtype: DType = typer.Option(DType("float32"), "--dtype", help="Model dtype."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    batch_size: int = typer.Option(8, "--batch-size", "-b", help="Rows of the batch."),
    unique_prompts: Optional[int] = typer.Option(
        None, "--unique-prompts", "-u", help="Distinct prompts among the rows (default 1)."
    ),
    dedup_ratio: Optional[float] = typer.Option(
        None, "--dedup-ratio", help="Instead of --unique-prompts: the prompt dedup ratio."
    ),
    prompt_len: int = typer.Option(256, "--prompt-len", "-p", help="Prompt tokens (the maximum with --padding)."),
    response_len: int = typer.Option(32, "--response-len", "-r", help="Response tokens (the maximum with --padding)."),
    padding: bool = typer.Option(False, "--padding", help="Vary lengths so rows carry padding."),
    baseline: Baseline = typer.Option(
        Baseline("packed"), "--baseline", help="packed (fair: same backend, no padding) or padded (plain HF forward)."
    ),
    varlen_backend: Optional[str] = typer.Option(
        None,
        "--varlen-backend",
        help="actor.varlen_backend: split mode's varlen backend (default: the one for the attention and --device).",
    ),
    liger: bool = typer.Option(False, "--liger", help="Apply Liger kernels before timing (GPU; else a skipped row)."),
    checkpointing: bool = typer.Option(
        False, "--checkpointing", help="Gradient checkpointing on every decoder layer (training mode), both arms."
    ),
    warmup: int = typer.Option(1, "--warmup", help="Untimed rounds of each arm per phase."),
    repeats: int = typer.Option(5, "--repeats", help="Timed rounds per phase."),
    phases: list[Phase] = typer.Option(list(Phase), "--phase", help="Phase to time (repeatable; default both)."),
    memory: bool = typer.Option(True, "--memory/--no-memory", help="Measure peak memory."),
    threads: int = typer.Option(
        1,
        "--threads",
        help="torch threads in the case process (default 1, as in the suites: on a loaded machine OpenMP threads stall each other; 0: torch's default).",
    ),
    timeout_s: float = typer.Option(
        600.0, "--timeout", help="Seconds the case process may run before it is a status=timeout row."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and the batch."),
    nproc: int = typer.Option(
        1,
        "--nproc",
        help="Data-parallel ranks: > 1 times no-regroup vs regroup over N spawned ranks (the batch is the global one).",
    ),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Also append the rows to this CSV."),
    max_memory: Optional[str] = typer.Option(None, "--max-memory", help=MAX_MEMORY_HELP),
) -> None:
    """One case from flags."""
    resolve_device(device)  # given explicitly: a device that is not here is an error, not a skipped row
    if unique_prompts is None and dedup_ratio is None:
        unique_prompts = 1
    try:
        actor = CASE_ACTOR.replace(
            attn_implementation=attn.value,
            use_split_attention=split,
            logits_mode=logits_mode.value,
            logits_memory_budget_mib=logits_memory_budget_mib,
            sharing=sharing.value,
            min_shared_tokens=min_shared_tokens,
            varlen_backend=varlen_backend,
        )
        case = Case(
            model=model,
            actor=actor,
            dtype=dtype.value,
            device=device,
            batch_size=batch_size,
            num_unique_prompts=unique_prompts,
            prompt_dedup_ratio=dedup_ratio,
            prompt_len=prompt_len,
            response_len=response_len,
            padding=padding,
            baseline=baseline.value,
            liger=liger,
            checkpointing=checkpointing,
            seed=seed,
            nproc=nproc,
        )
        measure = Measure(
            warmup=warmup,
            repeats=repeats,
            phases=tuple(p.value for p in phases),
            memory=memory,
            timeout_s=timeout_s,
            threads=threads,
        )
        refused = refused_arms(case, model_config(case.model), measure.phases, limit := parse_size(max_memory))
    except ValueError as e:
        fail(str(e))
    if len(refused) == len(ARMS):
        fail(f"{case.case_id}: {refused['dedup']}")
    if case.nproc > 1 and (why := ranks_too_many(case.nproc, case.model, DTYPES[case.dtype].itemsize)):
        fail(why)
    suite = Suite(name="run", cases=[case], measure=measure, device=device, seed=seed)
    if out is not None:
        rows = _sweep(suite, out, mode="append", max_memory=limit)
    else:
        with console.status(f"running {escape(case.case_id)}"):
            rows = case_rows(case, measure, max_memory=limit)
    _finish(rows, out, "zorro bench run")


bench_app.command("memory")(bench_memory.memory)


@bench_app.command(
    "gpu-time",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def gpu_time(ctx: typer.Context) -> None:
    """The seed's headline table in one process, its first row in the first minute (every option: --help).

    The model is built on the device, both arms timed interleaved per case (CUDA events on a GPU), a
    row appended per case, --budget-s stops between cases (zorro_harness.bench.gpu_time)."""
    from zorro_harness.bench import gpu_time as harness

    raise typer.Exit(harness.main(list(ctx.args), prog="zorro bench gpu-time"))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
