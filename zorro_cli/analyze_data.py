"""`zorro analyze --data FILE`: read and tokenize a dataset (zorro_harness.analyze.dataset), simulate the
trainer's batching and count what zorro shares (zorro_harness.analyze.workload_sim), print the report as
tables or JSON, and plot it (zorro_harness.analyze.plots)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from zorro_cli.console import console, err_console, escape, fail, print_json
from zorro_core.models.registry import model_shape
from zorro_harness.analyze.chat_template import MAX_TEMPLATE_CHARS
from zorro_harness.analyze.dataset import DatasetError, load_dataset
from zorro_harness.analyze.workload_sim import data_report
from zorro_harness.bench.inputs import model_config


@dataclass
class DataArgs:
    """The --data options of `zorro analyze`."""

    data: str
    tokenizer: Optional[str]
    chat_template: Optional[str]
    prompt_column: Optional[str]
    completion_column: Optional[str]
    batching: str
    batch_size: int
    group_size: int
    generation_batch_size: Optional[int]
    response_len: Optional[int]
    rollouts: bool
    max_len: Optional[int]
    seed: int
    model: str
    logits_mode: str
    plots: Optional[str]
    image_grid_column: Optional[str] = None
    image_column: Optional[str] = None
    image_token_id: Optional[int] = None
    spatial_merge: int = 2


MAX_TEMPLATE_BYTES = MAX_TEMPLATE_CHARS
"""The largest chat-template file read (checked before reading it)."""
MAX_SIMULATED_ROWS = 100_000_000
"""The most rows the batching simulation holds (a few int64 arrays of that many rows)."""


def _template(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    try:
        size = os.stat(path).st_size
        if size > MAX_TEMPLATE_BYTES:
            fail(f"{path}: the chat template is {size:,} bytes, over the {MAX_TEMPLATE_BYTES:,} zorro reads")
        with open(path, "rb") as f:
            raw = f.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as e:
        fail(f"{path}: cannot read the chat template ({e.strerror})")
    if len(raw) > MAX_TEMPLATE_BYTES:  # a pipe or device: its size was not known before reading
        fail(f"{path}: the chat template is over the {MAX_TEMPLATE_BYTES:,} bytes zorro reads")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"{path}: the chat template is not UTF-8 (byte {e.start + 1}: {e.reason})")


def _check_counts(a: DataArgs) -> None:
    """Every count option >= 1 (0 is not "the default"), and no simulation too large to hold."""
    for flag, value in (
        ("--batch-size", a.batch_size),
        ("--group-size", a.group_size),
        ("--generation-batch-size", a.generation_batch_size),
        ("--response-len", a.response_len),
        ("--max-len", a.max_len),
        ("--spatial-merge-size", a.spatial_merge),
    ):
        if value is not None and value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    if a.image_token_id is not None and a.image_token_id < 0:
        fail(f"--image-token-id must be >= 0, got {a.image_token_id}")
    if a.group_size > MAX_SIMULATED_ROWS:
        fail(f"--group-size {a.group_size:,} is over the {MAX_SIMULATED_ROWS:,} rows the simulation holds")


def run(a: DataArgs, as_json: bool) -> None:
    """Analyse a.data and print the report (tables, or JSON with as_json); exit 2 on bad input."""
    _check_counts(a)
    t0 = time.perf_counter()
    try:
        config = model_config(a.model)
    except ValueError as e:
        fail(str(e))
    shape = model_shape(config)
    context = a.max_len or getattr(config, "max_position_embeddings", None) or 2**31 - 1
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err_console, transient=True
    ) as bar:
        task = bar.add_task("reading", total=None)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage, completed=done, total=total)

        try:
            data = load_dataset(
                a.data,
                a.tokenizer,
                a.prompt_column,
                a.completion_column,
                _template(a.chat_template),
                progress,
                completions="all" if a.rollouts else "sample",
                vocab_size=getattr(config, "vocab_size", None),
                chat_template_name=a.chat_template,
                image_grid_column=a.image_grid_column,
                image_column=a.image_column,
                image_token_id=a.image_token_id,
                spatial_merge=a.spatial_merge,
            )
            simulated = data.rows * a.group_size
            if not a.rollouts and simulated > MAX_SIMULATED_ROWS:
                fail(
                    f"--group-size {a.group_size:,} x {data.rows:,} prompts is {simulated:,} rows, over the "
                    f"{MAX_SIMULATED_ROWS:,} the simulation holds (a smaller --group-size, or a sample of the file)"
                )
            t_read = time.perf_counter() - t0
            report = data_report(
                data,
                shape,
                a.model,
                context,
                batching=a.batching,
                batch_size=a.batch_size,
                group_size=a.group_size,
                response_len=a.response_len,
                generation_batch_size=a.generation_batch_size,
                logits_mode=a.logits_mode,
                rollouts=a.rollouts,
                seed=a.seed,
                progress=progress,
            )
        except (DatasetError, ValueError) as e:
            fail(str(e))
    report["seconds"] = {"read_and_tokenize": t_read, **report["seconds"], "total": time.perf_counter() - t0}
    if a.plots:
        from zorro_harness.analyze.plots import write_plots

        try:
            report["plots"] = write_plots(report, a.plots)
        except OSError as e:
            fail(f"{a.plots}: cannot write the plots ({e.strerror})")
    if as_json:
        print_json(report)
        return
    print_report(report)


def _n(x: float) -> str:
    return f"{x / 1e6:.1f}M" if x >= 10_000_000 else (f"{x / 1e3:.0f}K" if x >= 10_000 else f"{x:,.0f}")


def print_report(r: dict) -> None:
    """The report as rich tables."""
    d, b = r["data"], r["batching"]
    t = Table(title=escape(f"{os.path.basename(d['file'])}: {d['rows']:,} rows ({d['kind']}, {d['format']})"))
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("distinct prompts", f"{d['distinct_prompts']:,}")
    pt = d["prompt_tokens"]
    t.add_row("prompt tokens (min / median / max)", f"{pt['min']:.0f} / {pt['median']:.0f} / {pt['max']:.0f}")
    if d["completion_tokens"]:
        ct = d["completion_tokens"]
        t.add_row("completion tokens (min / median / max)", f"{ct['min']:.0f} / {ct['median']:.0f} / {ct['max']:.0f}")
    oc = d["over_context"]
    style = "[bold red]" if oc["rows"] else ""
    t.add_row(
        f"rows longer than the context ({oc['context']:,})",
        f"{style}{oc['rows']:,}"
        + (f" (longest {oc['longest']:,}; rows {oc['first_rows']}...)[/]" if oc["rows"] else ""),
    )
    im = d.get("images")
    if im:
        it = im["image_tokens_per_prompt"]
        t.add_row(
            "images (rows with images / images)", f"{im['rows_with_images']:,} / {im['images']:,} ({im['identity']})"
        )
        t.add_row(
            "image tokens a prompt (min / median / max)", f"{it['min']:.0f} / {it['median']:.0f} / {it['max']:.0f}"
        )
    if b["mode"] == "rollouts":
        t.add_row("batching", f"rollouts in file order, calls of {b['batch_size']} rows: {b['calls']:,} calls")
    else:
        t.add_row(
            "batching",
            f"{b['mode']}, batch {b['batch_size']}, group {b['group_size']}: {b['calls']:,} calls of {b['rows']:,} rows",
        )
        t.add_row("response lengths", escape(b["response_len"]))
    console.print(t)

    w = Table(title=escape(f"workload over every call ({r['model']}, logits_mode={r['logits_mode']})"))
    w.add_column("")
    w.add_column("tokens", justify="right")
    w.add_column("ideal speedup fwd / fwd+bwd", justify="right")
    p, sp, pp = r["prefix"], r["ideal_speedup"], r["prefix"]["ideal_speedup"]
    w.add_row("total (every row in full)", _n(r["total_tokens"]), "1.00x")
    w.add_row(
        'sharing="prompt" (identical prompts once)',
        f"{_n(r['unique_tokens'])} ({r['token_redundancy']:.0%} saved)",
        f"{sp['total_forward']:.2f}x / {sp['total_forward_backward']:.2f}x",
    )
    w.add_row(
        'sharing="prefix" (the trie, every shared run once)',
        f"{_n(p['unique_tokens'])} ({p['token_redundancy']:.0%} saved)",
        f"{pp['total_forward']:.2f}x / {pp['total_forward_backward']:.2f}x",
    )
    w.add_row("shared by the trie beyond identical prompts", _n(p["beyond_identical_prompts_tokens"]), "")
    im = r["data"].get("images")
    if im:
        tok, vis = im["image_tokens"], im["vision_tower_images"]
        w.add_row(
            'image tokens: every row / sharing="prompt"',
            f"{_n(tok['baseline'])} / {_n(tok['prompt'])} ({1 - tok['prompt'] / max(tok['baseline'], 1):.0%} saved)",
            "",
        )
        w.add_row("images through the vision tower: every row / dedup", f"{vis['baseline']:,} / {vis['dedup']:,}", "")
    w.add_row("prompt dedup ratio", f"{r['prompt_dedup_ratio']:.0%}", "")
    console.print(w)

    c = Table(title="per call (min / median / max)")
    c.add_column("")
    c.add_column("value", justify="right")
    pc = r["per_call"]
    for key, label, fmt in (
        ("rows", "rows", "{:.0f}"),
        ("prompt_dedup_ratio", "prompt dedup ratio", "{:.0%}"),
        ("ideal_speedup_prompt", 'ideal fwd+bwd, sharing="prompt"', "{:.2f}x"),
        ("ideal_speedup_prefix", 'ideal fwd+bwd, sharing="prefix"', "{:.2f}x"),
    ):
        q = pc[key]
        c.add_row(label, " / ".join(fmt.format(q[k]) for k in ("min", "median", "max")))
    sh = r["shared_prefix_lengths"]
    c.add_row(
        "tokens a prompt shares with another of its call", f"{sh['min']:.0f} / {sh['median']:.0f} / {sh['max']:.0f}"
    )
    console.print(c)

    m = Table(title="min_shared_tokens (sharing=prefix)")
    m.add_column("min_shared_tokens", justify="right")
    m.add_column("unique tokens", justify="right")
    m.add_column("ideal fwd+bwd", justify="right")
    for row in r["min_shared_tokens"]:
        m.add_row(
            str(row["min_shared_tokens"]), _n(row["unique_tokens"]), f"{row['ideal_speedup_forward_backward']:.2f}x"
        )
    console.print(m)

    g = Table(title="ideal speedup (fwd+bwd) by group size")
    for col in ("group size", "calls", "prompt dedup", 'sharing="prompt"', 'sharing="prefix"'):
        g.add_column(col, justify="right")
    for row in r["group_size_sweep"]:
        g.add_row(
            str(row["group_size"]),
            f"{row['calls']:,}",
            f"{row['prompt_dedup_ratio']:.0%}",
            f"{row['ideal_speedup_prompt']:.2f}x",
            f"{row['ideal_speedup_prefix']:.2f}x",
        )
    console.print(g)
    rec = r["recommendation"]
    pick = f'sharing="{rec["sharing"]}"' + (
        f", min_shared_tokens={rec['min_shared_tokens']}" if rec["min_shared_tokens"] else ""
    )
    console.print(f"[bold]pick:[/] {escape(pick)}: {escape(rec['reason'])}.")
    if "plots" in r:
        console.print(f"plots: {escape(', '.join(r['plots']))}")
    console.print(f"analysed in {r['seconds']['total']:.1f} s. Ideal: FLOPs only (`zorro bench` measures).")
