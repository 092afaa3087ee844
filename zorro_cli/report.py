"""`zorro report RESULTS...` (tables, pivot, plots), `zorro report compare OLD NEW` (regression gate)
and `zorro report stack RESULTS...` (the cumulative optimization stack, report_stack.py).
The logic lives in zorro_harness.bench.report; this module parses arguments and prints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from typer.core import TyperGroup

from zorro_cli.choices import Metric, Phase
from zorro_cli.console import check_name, console, escape, fail, refuse_writing_onto_inputs, write_or_fail
from zorro_cli.report_stack import stack
from zorro_harness.bench.files import write_bytes_atomically
from zorro_harness.bench.measure import format_number
from zorro_harness.bench.report import (
    compare_frames,
    compared_count,
    load_results,
    pivot_frame,
    pivots,
    plot,
    run_differences,
    spreadsheet_frame,
)


class _DefaultShow(TyperGroup):
    """`zorro report X.csv` means `zorro report show X.csv`; `compare` and `stack` stay sub-commands."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["show", *args]
        return super().parse_args(ctx, args)


MAX_COMPARE_ROWS = 50
"""`report compare` prints every row up to this many; past it, a summary and the rows that are not "same"."""
report_app = typer.Typer(
    cls=_DefaultShow,
    no_args_is_help=True,
    help="Merge result CSVs: pivot speedup by dedup ratio x prompt length, plot, compare runs.",
)


def _markdown(title: str, text) -> str:
    cols = [f"P={c}" for c in text.columns]
    lines = [f"**{title}**", "", "| prompt dedup ratio | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for ratio, row in text.iterrows():
        lines.append(f"| {ratio:.3f} | " + " | ".join(str(x) for x in row) + " |")
    return "\n".join(lines) + "\n"


def parse_fraction(text: str) -> float:
    """'5%' -> 0.05, '0.05' -> 0.05. A bare number must be a fraction below 1: '5' is refused
    (5% or 500%?), as is anything not finite or negative."""
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a fraction (use 5% or 0.05)") from None
    if not (math.isfinite(v) and 0 <= v < 10):
        raise ValueError(f"threshold {text!r} is out of range (use 5% or 0.05)")
    if not t.endswith("%") and v >= 1:
        raise ValueError(f"--fail-above {text!r}: is that {v:g}% or {v:.0%}? give the unit: {v:g}% or {v / 100:g}")
    return v


@report_app.command("show")
def show(
    results: list[Path] = typer.Argument(..., help="Result CSVs (later files win for the same case and phase)."),
    value: str = typer.Option(
        "speedup", "--value", help="Column to pivot: speedup, efficiency, ideal_speedup, dedup_ms_p50, ..."
    ),
    phase: Optional[Phase] = typer.Option(None, "--phase", help="Only this phase."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the pivots as Markdown tables."),
    csv_out: Optional[Path] = typer.Option(
        None, "--csv", help="Write the pivots (one row per configuration and dedup ratio) to this CSV."
    ),
    plots: Optional[Path] = typer.Option(
        None, "--plots", help="Write PNG plots (speedup, peak memory) into this directory."
    ),
) -> None:
    """Merge result CSVs and pivot `value` by prompt dedup ratio x prompt length, per configuration."""
    check_name("--csv", csv_out)
    check_name("--plots", plots)
    if plots is not None and plots.exists() and not plots.is_dir():
        fail(f"--plots {plots} is a file; it takes a directory to write the PNGs into")
    if csv_out is not None and csv_out.is_dir():
        fail(f"--csv {csv_out} is a directory; it takes a CSV file path")
    if csv_out is not None:
        refuse_writing_onto_inputs("--csv", csv_out, results)
        write_or_fail("--csv", csv_out, lambda: csv_out.parent.mkdir(parents=True, exist_ok=True))
    if plots is not None:
        write_or_fail("--plots", plots, lambda: plots.mkdir(parents=True, exist_ok=True))
    try:
        df = load_results(results)
    except ValueError as e:
        fail(str(e))
    if value not in df.columns:
        fail(f"no column {value!r} in the results")
    if phase is not None:
        df = df[df["phase"] == phase.value]
    tables = pivots(df, value)
    for title, _, text, _ in tables:
        if markdown:
            typer.echo(_markdown(title, text))
            continue
        t = Table(title=escape(title), title_justify="left")
        t.add_column("prompt dedup ratio", justify="right")
        for c in text.columns:
            t.add_column(f"P={c}", justify="right")
        for ratio, row in text.iterrows():
            t.add_row(f"{ratio:.3f}", *[str(x) for x in row])
        console.print(t)
    if not tables:
        console.print("[yellow]no ok rows to pivot[/]")
    bad = df[df["status"] != "ok"]
    if len(bad):
        summary = bad.groupby("status").size().to_dict()
        (typer.echo if markdown else console.print)(f"not ok: {summary}")
        for _, r in bad.iterrows():
            line = f"  {r['case_id']} {r['phase']}: {r['status']} {r.get('error', '') or ''}"
            typer.echo(line) if markdown else console.print(escape(line))
    if csv_out is not None:
        frame = spreadsheet_frame(pivot_frame(tables, value))
        write_or_fail("--csv", csv_out, lambda: write_bytes_atomically(csv_out, frame.to_csv(index=False).encode()))
        console.print(f"pivot written to {escape(str(csv_out))}")
    if plots is not None:
        for p in write_or_fail("--plots", plots, lambda: plot(df, plots)):
            console.print(f"plot written to {escape(str(p))}")


@report_app.command("compare")
def compare(
    old: Path = typer.Argument(..., help="Results of the reference run."),
    new: Path = typer.Argument(..., help="Results of the run to check."),
    fail_above: str = typer.Option(
        "5%", "--fail-above", help="Exit 1 when a case is worse by more than this (and beyond the p20-p80 noise)."
    ),
    metric: Metric = typer.Option(
        Metric("speedup"), "--metric", help="speedup (higher is better), dedup_ms or baseline_ms (lower is better)."
    ),
) -> None:
    """Compare two runs case by case; exit 1 on a regression beyond the threshold and the noise."""
    try:
        threshold = parse_fraction(fail_above)
        rows = compare_frames(load_results([old]), load_results([new]), metric.value, threshold)
    except ValueError as e:
        fail(str(e))
    if not compared_count(rows):
        fail(
            f"nothing compared: {old} and {new} share no (case, phase) that is ok in {old}"
            + ("" if any(v != "missing in new" for *_, v in rows) else f" ({new} has none of its rows)")
            + "; a gate that compares nothing fails"
        )
    differ = run_differences(old, new)
    if differ:
        console.print(
            escape(f"note: the two runs differ ({'; '.join(differ)}); their times compare only as far as that allows")
        )
    counts: dict[str, int] = {}
    for *_, verdict in rows:
        counts[verdict] = counts.get(verdict, 0) + 1
    shown = rows
    if len(rows) > MAX_COMPARE_ROWS:  # summarise: every row but "same", the regressions first, at most MAX
        shown = sorted((r for r in rows if r[-1] != "same"), key=lambda r: not r[-1].startswith("REGRESSION"))
        shown = shown[:MAX_COMPARE_ROWS]
    t = Table(title=escape(f"{metric.value}: {old} -> {new} (fail above {threshold:.1%} beyond p20-p80 noise)"))
    for c in ("case", "phase", "old", "new", "change", "verdict"):
        t.add_column(c, justify="right" if c in ("old", "new", "change") else "left")
    regressions = sum(n for v, n in counts.items() if v.startswith("REGRESSION"))
    for case, phase, vo, vn, change, verdict in shown:
        style = "red" if verdict.startswith("REGRESSION") else ("green" if verdict == "improved" else "")
        t.add_row(
            escape(str(case)),
            str(phase),
            "" if vo is None else format_number(vo, 3),
            "" if vn is None else format_number(vn, 3),
            "" if change is None else f"{change:+.1%}",
            f"[{style}]{verdict}[/]" if style else verdict,
        )
    if shown:
        console.print(t)
    if len(shown) < len(rows):
        console.print(
            f"{len(rows)} (case, phase) rows: "
            + ", ".join(f"{n} {escape(v)}" for v, n in sorted(counts.items()))
            + f"; {len(shown)} shown (not 'same', regressions first)"
        )
    if regressions:
        console.print(f"[red]{regressions} regression(s)[/]")
        raise typer.Exit(1)
    console.print("no regression beyond the threshold and the noise")


report_app.command("stack")(stack)


def register(app: typer.Typer) -> None:
    app.add_typer(report_app, name="report")
