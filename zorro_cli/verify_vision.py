"""`zorro verify vision`: the vision-language path against each row run alone (zorro_core.verify.vision)."""

from __future__ import annotations

import math
import time
from typing import Optional

import typer
from rich.table import Table

from zorro_cli.console import STATUS_STYLE, console, escape, fail, print_json
from zorro_core.verify.gradients import RULE
from zorro_core.verify.vision import BUGS, DTYPES, FAMILIES, MODES, SHARINGS, run_vision_case, vision_cases

HELP = (
    "Qwen2.5-VL, Qwen3-VL and Qwen3.5 dense and MoE (tiny random configs built in code) with images: several images per prompt, the "
    "same text with another image, an image recurring across groups. The deduplicated vision actor (each unique "
    "prompt and each distinct image once) and the plain one against each row run alone through the unmodified "
    "model with its own pixel_values in float64: log-probs, entropy, every gradient (the vision tower's "
    "included). Both sharing modes: prompt (whole prompts, text and images) and prefix (rows share runs of "
    "text and images, diverging at a different image). The same cases run in `zorro verify gradients "
    "--models tiny-qwen2.5-vl,tiny-qwen3-vl,tiny-qwen3.5-vl,tiny-qwen3.5-moe-vl`. Qwen3.5's gated DeltaNet "
    "layers run the float64 delta rule in the reference and in float64 cases. Exit code 1 on any failure.\n\n" + RULE
)


def register(verify_app: typer.Typer) -> None:
    """Add `vision` to `zorro verify`."""
    verify_app.command("vision", help=HELP)(vision)


def _list(values: Optional[list[str]], allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for value in values or [] for v in value.split(",") if v.strip()] or list(allowed)
    bad = [v for v in items if v not in allowed]
    if bad:
        fail(f"{flag}: unknown value {bad[0]!r}; choose from {', '.join(allowed)}")
    return items


def vision(
    families: Optional[list[str]] = typer.Option(
        None, "--families", help=f"Model types ({', '.join(FAMILIES)}; default all)."
    ),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help=f"dtypes ({', '.join(DTYPES)}; default all)."),
    mode: Optional[list[str]] = typer.Option(None, "--mode", help=f"{', '.join(MODES)} (default both)."),
    sharing: Optional[list[str]] = typer.Option(
        None, "--sharing", help=f"The deduplicated actor's sharing ({', '.join(SHARINGS)}; default both)."
    ),
    checkpointing: bool = typer.Option(
        True,
        "--checkpointing/--no-checkpointing",
        help="Also run float64 with gradient checkpointing and a frozen tower.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds weights, images and loss weights."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    inject_bug: Optional[str] = typer.Option(
        None, "--inject-bug", hidden=True, help=f"Hidden, for testing the verifier: plant a bug ({', '.join(BUGS)})."
    ),
) -> None:
    if inject_bug is not None and inject_bug not in BUGS:
        fail(f"--inject-bug: unknown bug {inject_bug!r}; choose from {', '.join(BUGS)}")
    fams = _list(families, FAMILIES, "--families")
    sharings = _list(sharing, SHARINGS, "--sharing")
    cases = vision_cases(fams, _list(dtype, DTYPES, "--dtype"), _list(mode, MODES, "--mode"), sharings=sharings)
    if checkpointing:
        cases += vision_cases(fams, ["float64"], ["split"], ["non-reentrant", "reentrant"], [True], sharings)
    t0 = time.perf_counter()
    results = [run_vision_case(c, seed, inject_bug) for c in cases]
    seconds = time.perf_counter() - t0
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error")}
    if as_json:
        print_json(
            {
                "counts": counts,
                "seconds": round(seconds, 3),
                "cases": [
                    {
                        "case": r.case.name,
                        "status": r.status,
                        "reason": r.reason,
                        "worst_ratio": r.worst_ratio if math.isfinite(r.worst_ratio) else None,
                        "worst_check": r.worst_check,
                    }
                    for r in results
                ],
            }
        )
    else:
        table = Table(title="zorro verify vision")
        for col in ("case", "status", "dedup log-prob err", "dedup worst grad", "worst err/tol", "reason"):
            table.add_column(col)
        for r in results:
            d = r.dedup
            table.add_row(
                escape(r.case.name),
                STATUS_STYLE[r.status],
                f"{d.log_prob:.1e}" if d else "",
                f"{d.worst_param[1]:.1e} ({escape(d.worst_param[0])})" if d else "",
                f"{r.worst_ratio:.2f} ({escape(r.worst_check)})" if math.isfinite(r.worst_ratio) else "",
                escape(r.reason),
            )
        console.print(table)
        console.print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors in {seconds:.1f} s")
    if counts["fail"] or counts["error"]:
        raise typer.Exit(1)
