"""A sweep: every case of a suite, one after the other, rows appended to a results file.

The library half of `zorro bench sweep` (the CLI prints what the callbacks report). The
results file is locked for the whole sweep (results.ResultsLock), a fresh start keeps the old
file as a numbered backup, and every row is appended whole (results.ResultWriter).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from zorro_harness.bench.environment import environment
from zorro_harness.bench.inputs import model_config
from zorro_harness.bench.results import (
    ResultsLock,
    ResultsWriteError,
    ResultWriter,
    backup,
    check_is_results,
    check_out,
    done_keys,
)
from zorro_harness.bench.runner import case_rows
from zorro_harness.bench.sidecar import read_sidecar, sidecar_path, update_last_run, write_sidecar
from zorro_harness.bench.suite import Case, Measure, Suite

MODES = ("replace", "resume", "append")
"""replace: start the file afresh (the old one becomes a backup); resume: skip every
case+phase already done in it; append: add rows whatever it holds."""

FAILED = ("error", "crashed", "timeout")
"""Statuses that make a sweep fail (exit 1); ok, oom and skipped are results."""


GIT_SAFE = ("-c", "core.fsmonitor=", "-c", "core.hooksPath=/dev/null", "--no-optional-locks")
"""What every git call here runs with: no fsmonitor command, no hook (from the environment, the
user's or the repository's config), no index written."""


def git_state(root: Optional[Path] = None) -> dict[str, Any]:
    """Commit and dirty flag of the checkout the code runs from (`root`: zorro's own folder);
    None for both when it is not a git checkout (an installed package): git is then not run.
    git is asked about that folder only (no GIT_* variable from the environment reaches it, it
    does not look above `root`), with hooks and fsmonitor off (GIT_SAFE)."""
    root = Path(__file__).resolve().parents[2] if root is None else root
    none: dict[str, Any] = {"git_sha": None, "git_dirty": None}
    if not (root / ".git").exists():
        return none
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *GIT_SAFE, *args], cwd=root, env=env, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        sha = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no") if sha else ""
        return {"git_sha": sha or None, "git_dirty": bool(dirty) if sha else None}
    except (OSError, subprocess.SubprocessError):
        return none


def command_line() -> str:
    """The command that runs this process, as the user typed it (`zorro ...` for the CLI)."""
    prog = sys.argv[0] if sys.argv else ""
    first = "zorro" if Path(prog).name in ("zorro", "main.py", "__main__.py") else prog
    return " ".join([first, *sys.argv[1:]])


def loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def now_utc() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def run_record(suite: Suite) -> dict[str, Any]:
    """The sidecar's record of this run: environment, code version, command, time, settings."""
    return {
        "started_utc": now_utc(),
        "command": command_line(),
        "python": sys.executable,
        **git_state(),
        "suite": suite.name,
        "suite_file": suite.source,
        "suite_text": Path(suite.source).read_text() if suite.source and Path(suite.source).is_file() else None,
        "seed": suite.seed,
        "measure": dataclasses.asdict(suite.measure),
        "cases": len(suite.cases),
        "cpu_count": os.cpu_count(),
        "loadavg_start": loadavg(),
        "environment": environment(),
    }


def unresolved_models(cases: list[Case]) -> dict[str, str]:
    """{model: why} for each model of `cases` that resolves to no config (checked when a suite
    loads, so that a typo is not found only when its case runs)."""
    out = {}
    for name in dict.fromkeys(c.model for c in cases):
        try:
            model_config(name)
        except ValueError as e:
            out[name] = str(e)
    return out


def _nothing(*_: Any) -> None:
    return None


def run_suite(
    suite: Suite,
    out: Path,
    mode: str = "replace",
    fault: Optional[str] = None,
    notify: Callable[[str], None] = _nothing,
    on_case: Callable[[Case, int, int], None] = _nothing,
    on_row: Callable[[dict], None] = _nothing,
    max_memory: Optional[int] = None,
) -> list[dict]:
    """Run the suite, appending rows to `out` as they finish; the rows written.

    mode: one of MODES. notify(text): a plain-text notice (backup made, cases skipped);
    on_case(case, i, n): case i of n starts; on_row(row): a row was written.
    max_memory: bytes a case may take (its estimate is refused past it, its process stopped past
    it); None: what the machine has available."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"{out} is a directory; --out takes a CSV file")
    check_out(out, mode, protect=(suite.source,) if suite.source else ())
    rows: list[dict] = []
    try:
        with ResultsLock(out):
            _run_locked(suite, out, mode, fault, notify, on_case, on_row, max_memory, rows)
    except ResultsWriteError as e:
        raise ResultsWriteError(f"{e}; {_kept(rows, out)}") from None
    except OSError as e:  # the lock, a backup's rename, a directory that cannot be made
        where = f" {e.filename}" if e.filename else ""
        raise ResultsWriteError(f"cannot write{where}: {e.strerror or e}; {_kept(rows, out)}") from None
    return rows


def _kept(rows: list[dict], out: Path) -> str:
    if not rows:
        return "nothing was measured"
    return f"the {len(rows)} row(s) measured before are kept in {out}; fix the cause and run again with --resume"


_TIMING = ("warmup", "repeats", "threads")


def _settings_differ(out: Path, suite: Suite) -> list[str]:
    """What differs between `suite`'s settings and those of the last run recorded in `out`'s sidecar:
    its name and the settings that change what a time means (warmup, repeats, threads; memory,
    timeout_s and phases do not)."""
    runs = read_sidecar(sidecar_path(out))["runs"]
    if not runs or not isinstance(runs[-1], dict):
        return []
    last = runs[-1]
    now = {
        "suite": suite.name,
        **{f"measure.{k}": v for k, v in dataclasses.asdict(suite.measure).items() if k in _TIMING},
    }
    then = {"suite": last.get("suite"), **{f"measure.{k}": v for k, v in (last.get("measure") or {}).items()}}
    out_ = []
    for k, v in now.items():
        was = then.get(k)
        if k in then and (list(was) if isinstance(was, (list, tuple)) else was) != (
            list(v) if isinstance(v, (list, tuple)) else v
        ):
            out_.append(f"{k} {was!r} -> {v!r}")
    return out_


def _run_locked(suite, out, mode, fault, notify, on_case, on_row, max_memory, rows) -> None:
    check_is_results(out, mode)
    if out.exists() and mode == "replace":
        kept = backup(out)
        notify(f"starting {out} afresh; the old one is now {kept} (--resume continues a file instead)")
    done = done_keys(out) if mode == "resume" else set()
    if mode == "resume" and out.exists():
        try:
            differ = _settings_differ(out, suite)
        except ValueError:
            differ = []  # a damaged sidecar: write_sidecar below keeps it and says so
        if differ:
            raise ValueError(
                f"--resume: {out} was measured with other settings ({'; '.join(differ)}): its rows and the new "
                "ones would not compare; resume with the same suite and options, or start afresh (without --resume)"
            )
    todo = [c for c in suite.cases if any((c.case_id, p) not in done for p in suite.measure.phases)]
    if len(todo) < len(suite.cases):
        notify(f"resume: {len(suite.cases) - len(todo)} case(s) already done in {out}, {len(todo)} to run")
    if any(c.device.startswith("cuda") for c in todo) and not _cuda_available():
        notify(
            "this suite runs on CUDA, which is not available here: its cases are written with "
            "status=skipped (run it on a GPU machine, or pass --device cpu)"
        )
    writer = ResultWriter(out)
    kept_sidecar, why = write_sidecar(sidecar_path(out), run_record(suite))
    if kept_sidecar is not None:
        notify(f"{why}: it is kept as {kept_sidecar}, and a new sidecar started")

    def emit(row: dict) -> None:
        if (row["case_id"], row["phase"]) in done:
            return
        row["finished_utc"] = now_utc()
        writer.append(row)
        rows.append(row)
        on_row(row)

    for i, case in enumerate(todo):
        on_case(case, i, len(todo))
        measure = suite.measure
        phases = tuple(p for p in measure.phases if (case.case_id, p) not in done)
        if phases != measure.phases:
            measure = Measure(**{**dataclasses.asdict(measure), "phases": phases})
        case_rows(case, measure, fault=fault, on_phase=emit, max_memory=max_memory)
    try:
        update_last_run(sidecar_path(out), finished_utc=now_utc(), loadavg_end=loadavg(), rows_written=len(rows))
    except ResultsWriteError as e:
        raise ResultsWriteError(f"every row is written, but the sidecar's end-of-run record is not: {e}") from None


def _cuda_available() -> bool:
    return torch.cuda.is_available()
