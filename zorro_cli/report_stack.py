"""`zorro report stack RESULTS...`: the cumulative optimization-stack table from benchmark rows.

baseline -> +flash_attention -> +liger -> +dedup -> +split_attention, per workload and phase,
each with tokens/s, peak memory, the step over the previous row and the total over the
baseline (zorro_harness.bench.stack_table: which case and arm each row comes from).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from zorro_cli.choices import Phase
from zorro_cli.console import check_name, console, escape, fail, refuse_writing_onto_inputs, write_or_fail
from zorro_harness.bench.files import write_bytes_atomically
from zorro_harness.bench.report import load_results, spreadsheet_frame
from zorro_harness.bench.stack_table import WORKLOAD, missing_configs, stack_needs, stack_report

COLUMNS = ("config", "tokens/s", "peak MiB", "step", "step MiB", "total", "total MiB", "status", "from")


def _num(v, fmt: str) -> str:
    try:
        v = float(v)
    except (TypeError, ValueError):
        return ""
    return "" if math.isnan(v) else fmt.format(v)


def _mib(v, signed: bool = False) -> str:
    try:
        small = abs(float(v)) < 100
    except (TypeError, ValueError):
        return ""
    return _num(v, ("{:+,.1f}" if small else "{:+,.0f}") if signed else ("{:,.1f}" if small else "{:,.0f}"))


def _cells(r) -> list[str]:
    return [
        r["config"],
        _num(r["tokens_per_s"], "{:,.0f}"),
        _mib(r["peak_mem_mib"]),
        _num(r["step_speedup"], "{:.2f}x"),
        _mib(r["step_mem_delta_mib"], True),
        _num(r["total_speedup"], "{:.2f}x"),
        _mib(r["total_mem_delta_mib"], True),
        str(r["status"]),
        str(r["label"]),
    ]


def _title(key: dict) -> str:
    pad = ", padded lengths" if str(key.get("padding", "")).lower() == "true" else ""
    return (
        f"{key.get('model', '')} {key.get('dtype', '')} {key.get('device', '')} B={key.get('batch_size', '')} "
        f"unique={key.get('num_unique_prompts', '')} P={key.get('prompt_len', '')} R={key.get('response_len', '')} "
        f"logits={key.get('logits_mode', '')}{pad}: {key.get('phase', '')}"
    )


def _notes(g) -> list[str]:
    """Why rows have no figures and where a row came from another case, configs with the same text joined."""
    by_text: dict[str, list[str]] = {}
    for _, r in g.iterrows():
        if r["status"] != "ok":
            by_text.setdefault(f"{r['status']}" + (f" ({r['reason']})" if r.get("reason") else ""), []).append(
                r["config"]
            )
        if r.get("note"):
            by_text.setdefault(str(r["note"]), []).append(r["config"])
    notes = [f"{', '.join(configs)}: {text}" for text, configs in by_text.items()]
    device = str(g["device"].iloc[0]) if "device" in g.columns and len(g) else "cpu"
    absent = missing_configs(list(g["config"]), device or "cpu")
    if absent:
        notes.append(absent)
    if (g["status"] != "ok").any():
        notes.append(
            "rows without figures are left out of the chain: the next row's step is over the nearest row above with figures"
        )
    return notes


def stack(
    results: list[Path] = typer.Argument(
        ..., help="Benchmark result CSVs (later files win for the same case and phase)."
    ),
    phase: Optional[Phase] = typer.Option(None, "--phase", help="Only this phase."),
    markdown: bool = typer.Option(False, "--markdown", help="Print Markdown tables."),
    csv_out: Optional[Path] = typer.Option(None, "--csv", help="Write the stack tables to this CSV."),
) -> None:
    """The cumulative table: baseline, + flash attention, + liger, + dedup, + split attention (see suites/stack.toml)."""
    check_name("--csv", csv_out)
    if csv_out is not None:
        if csv_out.is_dir():
            fail(f"--csv {csv_out} is a directory; it takes a CSV file path")
        refuse_writing_onto_inputs("--csv", csv_out, results)
        write_or_fail("--csv", csv_out, lambda: csv_out.parent.mkdir(parents=True, exist_ok=True))
    try:
        df = load_results(results)
        if phase is not None:
            df = df[df["phase"] == phase.value]
        table = stack_report(df)
    except ValueError as e:
        fail(str(e))
    if table.empty:
        devices = sorted(set(df["device"].astype(str))) if "device" in df.columns and len(df) else ["cpu"]
        fail(
            f"{', '.join(map(str, results))}: not a stack sweep, no row of any stack config; per workload the "
            f"stack needs {stack_needs(devices)} (suites/stack.toml, stack_cpu.toml)"
        )
    by = [c for c in WORKLOAD if c in table.columns]
    for key, g in table.groupby(by, sort=False, dropna=False):
        title = _title(dict(zip(by, key if isinstance(key, tuple) else (key,))))
        notes = _notes(g)
        if markdown:
            lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * 6 + "---|---|"]
            lines += ["| " + " | ".join(_cells(r)) + " |" for _, r in g.iterrows()]
            typer.echo("\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n")
            continue
        t = Table(title=escape(title), title_justify="left")
        for c in COLUMNS:
            t.add_column(c, justify="left" if c in ("config", "status", "from") else "right")
        for _, r in g.iterrows():
            cells = [escape(c) for c in _cells(r)]
            if r["status"] != "ok":
                cells[7] = f"[yellow]{cells[7]}[/]"
            t.add_row(*cells)
        console.print(t)
        for n in notes:
            console.print(f"  note: {escape(n)}")
    if csv_out is not None:
        frame = spreadsheet_frame(table)
        write_or_fail("--csv", csv_out, lambda: write_bytes_atomically(csv_out, frame.to_csv(index=False).encode()))
        console.print(f"stack table written to {escape(str(csv_out))}")
