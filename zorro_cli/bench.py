"""`zorro bench sweep SUITE` and `zorro bench run`: time the deduplicated actor against the baseline."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zorro_core.bench.measure import format_speedup
from zorro_core.bench.results import ResultWriter, done_keys, sidecar_path, update_last_run, write_sidecar
from zorro_core.bench.suite import PHASES, Case, Measure, Suite, load_suite

bench_app = typer.Typer(help="Time the deduplicated actor against the packed baseline.", no_args_is_help=True)
console = Console(emoji=False)  # case ids hold ":mask:", which rich would draw as an emoji
if not console.is_terminal:  # logs and pipes: wide enough that case ids stay readable
    console = Console(width=140, emoji=False)

FAILED = ("error", "crashed", "timeout")


def git_state() -> dict[str, Any]:
    """Commit and dirty flag of the checkout the code runs from (None outside git)."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return {"git_sha": sha or None, "git_dirty": bool(dirty) if sha else None}
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": None, "git_dirty": None}


def run_record(suite: Suite) -> dict[str, Any]:
    """The sidecar's record of this run: environment, code version, command, time, settings."""
    from .env import environment

    rec: dict[str, Any] = {
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["zorro" if Path(sys.argv[0]).name in ("zorro", "main.py", "__main__.py") else sys.argv[0]]
                            + sys.argv[1:]),
        "python": sys.executable,
        **git_state(),
        "suite": suite.name, "suite_file": suite.source,
        "suite_text": Path(suite.source).read_text() if suite.source and Path(suite.source).is_file() else None,
        "seed": suite.seed, "measure": dataclasses.asdict(suite.measure),
        "cases": len(suite.cases), "cpu_count": os.cpu_count(), "loadavg_start": _loadavg(),
        "environment": environment(),
    }
    return rec


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cell(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    v = row.get(key)
    if v in (None, ""):
        return "-"
    try:
        return fmt.format(float(v))
    except (TypeError, ValueError):
        return str(v)


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
    t = Table(title=title, caption=f"all cases: {common}" if common else None)
    for col, just in [("case", "left"), ("phase", "left"), ("baseline ms", "right"), ("dedup ms", "right"),
                      ("speedup", "right"), ("ideal", "right"), ("eff.", "right"), ("peak MiB b/d", "right"),
                      ("status", "left")]:
        t.add_column(col, justify=just)
    for label, r in zip(labels, rows):
        sp = format_speedup(float(r["speedup"]), float(r.get("speedup_err") or "nan")) if r.get("speedup") not in (None, "") else "-"
        status = r["status"] if r["status"] == "ok" else f"[red]{r['status']}[/]: {escape(str(r.get('error', ''))[:60])}"
        mem = f"{_cell(r, 'baseline_peak_mem_mib', '{:.0f}')}/{_cell(r, 'dedup_peak_mem_mib', '{:.0f}')}"
        t.add_row(escape(label), r["phase"].replace("forward_backward", "fwd+bwd"), _cell(r, "baseline_ms_p50"), _cell(r, "dedup_ms_p50"), sp,
                  _cell(r, "ideal_speedup"), _cell(r, "efficiency"), mem, status)
    return t


def run_suite(suite: Suite, out: Path, mode: str = "replace", fault: Optional[str] = None) -> list[dict]:
    """Run the suite, appending rows to `out` as they finish.

    mode: "replace" starts `out` afresh, "resume" skips every case+phase already done in it,
    "append" adds rows to it whatever it holds."""
    from zorro_core.bench.runner import case_rows

    import torch

    if mode not in ("replace", "resume", "append"):
        raise ValueError(f"unknown mode {mode!r}")
    if out.exists() and mode == "replace":
        backup = out.with_name(out.name + ".bak")
        console.print(f"[yellow]starting {out} afresh[/]; the old one is now {backup} (--resume continues a file instead)")
        out.replace(backup)
        if sidecar_path(out).exists():
            sidecar_path(out).replace(out.with_name(out.stem + ".json.bak"))
    done = done_keys(out) if mode == "resume" else set()
    todo = [c for c in suite.cases if any((c.case_id, p) not in done for p in suite.measure.phases)]
    skipped_done = len(suite.cases) - len(todo)
    if skipped_done:
        console.print(f"resume: {skipped_done} case(s) already done in {out}, {len(todo)} to run")
    if any(c.device.startswith("cuda") for c in todo) and not torch.cuda.is_available():
        console.print("[yellow]this suite runs on CUDA, which is not available here: its cases are written with "
                      "status=skipped (run it on a GPU machine, or pass --device cpu)[/]")
    writer = ResultWriter(out)
    write_sidecar(sidecar_path(out), run_record(suite))
    rows: list[dict] = []
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[case]}"), console=console, transient=False)

    def on_row(row: dict) -> None:
        if (row["case_id"], row["phase"]) in done:
            return
        row["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        writer.append(row)
        rows.append(row)
        sp = format_speedup(float(row["speedup"]), float(row.get("speedup_err") or "nan")) if row.get("speedup") not in (None, "") else "-"
        progress.console.print(f"  {escape(row['case_id'])} {row['phase']}: {sp} (ideal {row.get('ideal_speedup', '-')}) {row['status']}")

    with progress:
        task = progress.add_task(suite.name, total=len(todo), case="")
        for case in todo:
            progress.update(task, case=case.case_id)
            measure = suite.measure
            phases = tuple(p for p in measure.phases if (case.case_id, p) not in done)
            if phases != measure.phases:
                measure = Measure(**{**dataclasses.asdict(measure), "phases": phases})
            case_rows(case, measure, fault=fault, on_phase=on_row)
            progress.advance(task)
    update_last_run(sidecar_path(out), finished_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                    loadavg_end=_loadavg(), rows_written=len(rows))
    return rows


def _finish(rows: list[dict], out: Optional[Path], title: str) -> None:
    if rows:
        console.print(results_table(rows, title))
    failed = [r for r in rows if r["status"] in FAILED]
    if out is not None:
        console.print(f"rows appended to [bold]{out}[/], environment in {sidecar_path(out)}")
    if failed:
        console.print(f"[red]{len(failed)} row(s) failed[/] (status {', '.join(sorted({r['status'] for r in failed}))})")
        raise typer.Exit(1)


@bench_app.command("sweep")
def sweep(
    suite_file: Path = typer.Argument(..., help="Suite TOML (see suites/)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="CSV to write (default results/<suite>.csv)."),
    resume: bool = typer.Option(False, "--resume", help="Keep the CSV and skip every case+phase already done."),
    filters: list[str] = typer.Option([], "--filter", "-k", help="Only cases matching: key=value (glob) on a case field, else a substring/glob of the case id. Repeatable (all must match)."),
    device: Optional[str] = typer.Option(None, "--device", help="Run every case on this device instead of the suite's."),
    repeats: Optional[int] = typer.Option(None, "--repeats", help="Override the suite's timed repeats."),
    warmup: Optional[int] = typer.Option(None, "--warmup", help="Override the suite's warmup rounds."),
    memory: Optional[bool] = typer.Option(None, "--memory/--no-memory", help="Override the suite's peak-memory setting."),
    list_only: bool = typer.Option(False, "--list", help="Print the cases and exit."),
) -> None:
    """Run every case of a suite, each in its own process, appending one row per case and phase."""
    try:
        suite = load_suite(suite_file)
        if device:
            suite = suite.on_device(device)
        suite = suite.filtered(filters)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2)
    overrides = {k: v for k, v in (("repeats", repeats), ("warmup", warmup), ("memory", memory)) if v is not None}
    if overrides:
        suite.measure = Measure(**{**dataclasses.asdict(suite.measure), **overrides})
    if list_only:
        for c in suite.cases:
            typer.echo(c.case_id)
        return
    if not suite.cases:
        console.print("[yellow]no case matches[/]")
        raise typer.Exit(2)
    out = out or Path("results") / f"{suite.name}.csv"
    rows = run_suite(suite, out, mode="resume" if resume else "replace")
    _finish(rows, out, f"zorro bench sweep {suite.name}")


@bench_app.command("run")
def run(
    model: str = typer.Option("small-qwen3", "--model", help="Preset, local checkpoint, or a model in the local HF cache."),
    attn: str = typer.Option("sdpa", "--attn", help="eager, sdpa, flash_attention_2/3, flex_attention (with --mask) or auto."),
    split: bool = typer.Option(True, "--split/--mask", help="Dedup arm: split attention (two varlen calls) or one masked call."),
    logits_mode: str = typer.Option("compute", "--logits-mode", help="none, compute or memory."),
    dtype: str = typer.Option("float32", "--dtype"),
    device: str = typer.Option("cpu", "--device"),
    batch_size: int = typer.Option(8, "--batch-size", "-b"),
    unique_prompts: Optional[int] = typer.Option(None, "--unique-prompts", "-u", help="Distinct prompts among the rows (default 1)."),
    dedup_ratio: Optional[float] = typer.Option(None, "--dedup-ratio", help="Instead of --unique-prompts: the prompt dedup ratio."),
    prompt_len: int = typer.Option(256, "--prompt-len", "-p"),
    response_len: int = typer.Option(32, "--response-len", "-r"),
    padding: bool = typer.Option(False, "--padding", help="Vary lengths so rows carry padding."),
    baseline: str = typer.Option("packed", "--baseline", help="packed (fair: same backend, no padding) or padded (plain HF forward)."),
    varlen_backend: Optional[str] = typer.Option(None, "--varlen-backend"),
    liger: bool = typer.Option(False, "--liger", help="Apply Liger kernels before timing (GPU; else a skipped row)."),
    checkpointing: bool = typer.Option(False, "--checkpointing", help="Gradient checkpointing on every decoder layer (training mode), both arms."),
    warmup: int = typer.Option(1, "--warmup"),
    repeats: int = typer.Option(5, "--repeats"),
    phases: list[str] = typer.Option(list(PHASES), "--phase", help="forward and/or forward_backward (repeatable)."),
    memory: bool = typer.Option(True, "--memory/--no-memory", help="Measure peak memory."),
    threads: int = typer.Option(0, "--threads", help="torch threads (0: default)."),
    timeout_s: float = typer.Option(600.0, "--timeout"),
    seed: int = typer.Option(0, "--seed"),
    nproc: int = typer.Option(1, "--nproc", help="Data-parallel ranks: > 1 times no-regroup vs regroup over N spawned ranks (the batch is the global one)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Also append the rows to this CSV."),
) -> None:
    """One case from flags."""
    if unique_prompts is None and dedup_ratio is None:
        unique_prompts = 1
    try:
        case = Case(model=model, attn_implementation=attn, split_attention=split, logits_mode=logits_mode, dtype=dtype,
                    device=device, batch_size=batch_size, num_unique_prompts=unique_prompts, prompt_dedup_ratio=dedup_ratio,
                    prompt_len=prompt_len, response_len=response_len, padding=padding, baseline=baseline,
                    varlen_backend=varlen_backend, liger=liger, checkpointing=checkpointing, seed=seed, nproc=nproc)
        measure = Measure(warmup=warmup, repeats=repeats, phases=tuple(phases), memory=memory, timeout_s=timeout_s, threads=threads)
    except ValueError as e:
        console.print(f"[red]error:[/] {e}")
        raise typer.Exit(2)
    suite = Suite(name="run", cases=[case], measure=measure, device=device, seed=seed)
    if out is not None:
        rows = run_suite(suite, out, mode="append")
    else:
        from zorro_core.bench.runner import case_rows

        with console.status(f"running {case.case_id}"):
            rows = case_rows(case, measure)
    _finish(rows, out, "zorro bench run")


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
