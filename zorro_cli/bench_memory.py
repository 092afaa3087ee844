"""`zorro bench memory`: saved-for-backward bytes per path and the longest prompt that fits
(zorro_harness.bench.memory counts; this module parses options, prints and writes)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from zorro_cli.console import console, err_console, escape, fail
from zorro_cli.signals import Interrupted, stopped_by_signals
from zorro_core.models.presets import PRESETS
from zorro_harness.bench.files import replace_atomically, short_name
from zorro_harness.bench.memory import MemoryCase, count_isolated, longest_prompt, narrowed_config, parameter_bytes
from zorro_harness.bench.results import ResultsWriteError, TableOut
from zorro_harness.bench.schedule_memory import ScheduleCase

GIB = 1024**3


def _ints(values: Optional[list[str]], default: list[int], flag: str) -> list[int]:
    out = [v.strip() for item in (values or []) for v in item.split(",") if v.strip()] or [str(d) for d in default]
    try:
        nums = [int(v) for v in out]
    except ValueError:
        fail(f"{flag}: whole numbers, comma-separated, got {', '.join(out)}")
    if any(n < 1 for n in nums):
        fail(f"{flag}: every value must be >= 1, got {', '.join(out)}")
    return list(dict.fromkeys(nums))


PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""What --plot writes, by the name's suffix (named exactly: nothing is appended)."""
OWNER = "`zorro bench memory`"
COLUMNS = ("model", "unique", "logits_mode", "path", "status")
"""Columns every memory CSV has: an existing --out without them is another command's file."""


def _check_plot(plot: Path, out: Optional[Path]) -> None:
    if plot.suffix.lower() not in PLOT_SUFFIXES:
        fail(f"--plot {escape(short_name(plot))}: name a {', '.join(PLOT_SUFFIXES)} file (the suffix picks the format)")
    try:
        # the plot's own file, checked as a results file is (no header to match: an image is replaced)
        TableOut(plot, "--plot", OWNER).check(also=(out,))
    except ValueError as e:
        fail(str(e))


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["logits_mode"] for r in rows})
    uniques = sorted({r["unique"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for i, path_name in enumerate(("zorro-gather", "zorro")):
            ys = [
                next(
                    r["vs_ideal"]
                    for r in rows
                    if r["logits_mode"] == mode and r["unique"] == u and r["path"] == path_name
                )
                for u in uniques
            ]
            ax.bar([j + 0.38 * i for j in range(len(uniques))], ys, width=0.36, label=path_name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="ideal")
        ax.set_xticks([j + 0.19 for j in range(len(uniques))], [f"U={u}" for u in uniques])
        ax.set_ylim(0.9, max(1.3, max(r["vs_ideal"] for r in rows if r["path"] != "packed") + 0.05))
        ax.set_title(f"logits {mode}")
        ax.set_ylabel("saved bytes / ideal")
        ax.legend(fontsize=8)
    r0 = rows[0]
    fig.suptitle(
        f"{r0['model']}: B={r0['batch']}, P={r0['prompt_len']}, R={r0['response_len']}, {r0['dtype']}", fontsize=10
    )
    fig.tight_layout()
    # the exact name, through a temporary file renamed over it (never through a link)
    replace_atomically(path, lambda f: fig.savefig(f, dpi=110, format=path.suffix.lower().lstrip(".")))
    plt.close(fig)


def memory(
    model: str = typer.Option("Qwen/Qwen3-8B", "--model", help="A preset (its shape, random weights)."),
    batch: int = typer.Option(16, "--batch", min=1, help="B, rows of the batch."),
    prompt_len: int = typer.Option(8192, "--prompt-len", min=2, help="P, tokens of every prompt."),
    response_len: int = typer.Option(1024, "--response-len", min=1, help="R, tokens of every response."),
    unique: Optional[list[str]] = typer.Option(None, "--unique", help="U values, comma-separated (default 1,2,4)."),
    logits_mode: Optional[list[str]] = typer.Option(
        None, "--logits-mode", help="actor.logits_mode values: compute and/or memory (default both)."
    ),
    dtype: str = typer.Option("bfloat16", "--dtype", help="Model dtype (bfloat16 or float32)."),
    layers: int = typer.Option(1, "--layers", min=1, help="Decoder layers built and counted (scaled to the model's)."),
    narrow: int = typer.Option(8, "--narrow", min=1, help="Divide widths (heads, hidden, MLP, vocabulary) by this."),
    gpu_gib: float = typer.Option(141.0, "--gpu-gib", help="GPU memory for the longest-prompt estimate (H200: 141)."),
    shards: int = typer.Option(
        8, "--shards", min=1, help="FSDP ranks sharing weights, gradients and AdamW state (16 bytes a parameter)."
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the rows as CSV here."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a bar plot (PNG) of each path against the ideal."),
    budget: Optional[int] = typer.Option(
        None,
        "--budget",
        min=1,
        help="A micro-batch token budget: count the prompt-once schedule against the within-micro-batch path "
        "at it (peak and saved bytes, with and without checkpointing, the longest prompt) instead of the "
        "unbudgeted paths.",
    ),
) -> None:
    """Bytes saved for backward per decoder layer and in total: packed baseline, zorro (gather-free,
    flash_cpu), zorro's pre-merge GPU path, and the ideal; counted exactly on CPU. With --budget: the
    prompt-once schedule against the within-micro-batch path at that budget."""
    if model not in PRESETS:
        fail(f"--model: unknown preset {escape(model)!r} (`zorro env` lists them)")
    if dtype not in ("bfloat16", "float32"):
        fail(f"--dtype must be bfloat16 or float32, got {escape(dtype)}")
    modes = [v.strip() for item in (logits_mode or ["compute,memory"]) for v in item.split(",") if v.strip()]
    if bad := [m for m in modes if m not in ("compute", "memory")]:
        fail(f"--logits-mode: unknown value(s) {', '.join(map(escape, bad))}; choose compute and/or memory")
    uniques = _ints(unique, [1, 2, 4], "--unique")
    if not math.isfinite(gpu_gib) or gpu_gib <= 0:
        fail(f"--gpu-gib must be a positive number of GiB, got {gpu_gib}")
    short_p = max(1, prompt_len // 8)  # the second length the longest prompt is read off (never P itself)
    try:
        budget_bytes = gpu_gib * GIB - parameter_bytes(model) / shards
        narrowed_config(model, layers, narrow)  # refuse a shape before any process starts
    except ValueError as e:
        fail(str(e))
    # every output checked before the first count (minutes at real sizes), as a sweep's
    table_out = TableOut(out, "--out", OWNER, COLUMNS) if out is not None else None
    if table_out is not None:
        try:
            table_out.check(also=(plot,))
        except ValueError as e:
            fail(str(e))
    if plot is not None:
        if budget is not None:
            fail("--plot draws the unbudgeted paths; it does not go with --budget")
        _check_plot(plot, out)
    err_console.print(size_note(len(modes) * len(uniques), batch, prompt_len, response_len, layers, narrow))
    if budget is not None:
        from zorro_cli import bench_schedule

        cases = [
            ScheduleCase(model, batch, prompt_len, response_len, u, budget, m, dtype, layers, narrow)
            for m in modes
            for u in uniques
        ]
        bench_schedule.run(cases, gpu_gib, budget_bytes, shards, table_out, out)
        return
    rows: list[dict] = []
    fits: list[tuple] = []
    failed: list[str] = []
    try:
        with stopped_by_signals():
            if table_out is None:
                _count_all(model, batch, prompt_len, response_len, uniques, modes, dtype, layers, narrow, short_p,
                           budget_bytes, rows, fits, failed, None)  # fmt: skip
            else:
                with table_out:
                    _count_all(model, batch, prompt_len, response_len, uniques, modes, dtype, layers, narrow, short_p,
                               budget_bytes, rows, fits, failed, table_out)  # fmt: skip
    except Interrupted as e:
        kept = f"the {len(rows)} row(s) counted are kept in {out}" if out is not None and rows else "nothing is kept"
        fail(f"interrupted by {e.signal.name}: {kept}", code=128 + e.signal)
    except (ResultsWriteError, OSError) as e:
        fail(f"--out: {e}", code=1)
    except ValueError as e:  # the results file is busy (a sweep or another command writes it)
        fail(str(e))
    table = Table(title=f"saved for backward: {escape(model)}, B={batch}, P={prompt_len}, R={response_len}, {dtype}")
    for col in ("logits", "U", "path", "tokens", "per layer GiB", "total GiB", "vs ideal"):
        table.add_column(col, justify="left" if col in ("logits", "path") else "right")
    for r in rows:
        if r["status"] != "ok":
            continue
        table.add_row(
            r["logits_mode"],
            str(r["unique"]),
            r["path"],
            str(r["tokens"]),
            f"{r['per_layer_bytes'] / GIB:.3f}",
            f"{r['total_bytes'] / GIB:.1f}",
            f"{r['vs_ideal']:.3f}",
        )
    console.print(table)
    fit = Table(
        title=f"longest prompt that fits {gpu_gib:g} GiB at B={batch}, R={response_len} "
        f"(weights, grads and AdamW state over {shards} FSDP shards)"
    )
    for col in ("logits", "U", "packed", "zorro", "zorro-gather", "packed ckpt", "zorro ckpt", "zorro-gather ckpt"):
        fit.add_column(col, justify="right")
    for mode, u, lens, lens_ckpt in fits:
        cells = [f"{d[p]:,.0f}" for d in (lens, lens_ckpt) for p in ("packed", "zorro", "zorro-gather")]
        fit.add_row(mode, str(u), *cells)
    console.print(fit)
    console.print(
        f"Counted on CPU with {layers} decoder layer(s) and widths / {narrow} (head dims kept), scaled back. "
        "The kernel saves what flash-attn 2 saves (q, k, v, out, lse). 'ckpt': with gradient checkpointing "
        "of every layer, derived (each layer keeps its input; one layer's saved set at a time in backward). "
        "0: not even P/8 fits."
    )
    if plot is not None and fits:
        try:
            _plot([r for r in rows if r["status"] == "ok"], plot)
        except OSError as e:
            fail(f"--plot {escape(short_name(plot))}: cannot write it ({e.strerror or e})", code=1)
    if failed:
        fail("; ".join(failed), code=1)


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    return cols


LARGE_COUNT_TOKENS = 1 << 20
"""Tokens of one count past which the size note says it may take long (CPU, every token computed)."""


def size_note(cases: int, batch: int, prompt_len: int, response_len: int, layers: int, narrow: int) -> str:
    """What the counts will run, said before the first: a count runs every token of the batch on CPU."""
    tokens = batch * (prompt_len + response_len)
    note = (
        f"counting {cases} case(s), each two runs of B={batch} rows x {prompt_len + response_len:,} tokens "
        f"({tokens:,} tokens) through {layers} layer(s) narrowed {narrow}x, on CPU"
    )
    if tokens > LARGE_COUNT_TOKENS:
        note += (
            f"; over {LARGE_COUNT_TOKENS:,} tokens a count can take many minutes and as many GiB of host memory "
            "as the narrowed activations need: Ctrl-C keeps the rows counted"
        )
    return note


def _count_all(
    model, batch, prompt_len, response_len, uniques, modes, dtype, layers, narrow, short_p, budget, rows, fits, failed,
    table_out: Optional[TableOut],
) -> None:  # fmt: skip
    """Count every case into `rows` and `fits`; the CSV rewritten after each (an interrupt keeps them)."""
    for mode in modes:
        for u in uniques:
            case = MemoryCase(model, batch, prompt_len, response_len, u, mode, dtype, layers, narrow)
            try:
                if batch % u:
                    raise ValueError(f"--batch {batch} must be a multiple of --unique {u}")
                with console.status(f"counting {escape(model)} U={u} logits {mode}"):
                    full = count_isolated(case)
                    short = count_isolated(dataclasses.replace(case, prompt_len=short_p))
            except ValueError as e:  # a case that fails is a row with its reason; the others go on
                failed.append(str(e))
                rows.append({**dataclasses.asdict(case), "path": "", "status": str(e)})
            else:
                rows += [{**r.as_dict(), "status": "ok"} for r in full]
                fits.append((mode, u, longest_prompt(short, full, budget), longest_prompt(short, full, budget, True)))
            if table_out is not None:
                table_out.write(rows, _columns(rows))
