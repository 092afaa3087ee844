"""`zorro bench memory --budget`: the prompt-once schedule against the within-micro-batch path
(zorro_harness.bench.schedule_memory counts; this module prints and writes)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.table import Table

from zorro_cli.console import console, escape, fail
from zorro_cli.signals import Interrupted, stopped_by_signals
from zorro_harness.bench.results import ResultsWriteError, TableOut
from zorro_harness.bench.schedule_memory import (
    LONGEST_PROMPT_CEILING,
    SCHEDULE_PATHS,
    ScheduleCase,
    count_schedule_isolated,
    ideal_speedup,
    longest_prompt_search,
    memoised,
)

GIB = 1024**3


def run(
    cases: list[ScheduleCase],
    gpu_gib: float,
    budget_bytes: float,
    shards: int,
    table_out: Optional[TableOut],
    out: Optional[Path],
) -> None:
    """Count every case, search its longest prompts, print, write the CSV after each case."""
    count = memoised(count_schedule_isolated)
    rows: list[dict] = []
    failed: list[str] = []
    try:
        with stopped_by_signals():
            if table_out is None:
                _count_all(cases, count, budget_bytes, rows, failed, None)
            else:
                with table_out:
                    _count_all(cases, count, budget_bytes, rows, failed, table_out)
    except Interrupted as e:
        kept = f"the {len(rows)} row(s) counted are kept in {out}" if out is not None and rows else "nothing is kept"
        fail(f"interrupted by {e.signal.name}: {kept}", code=128 + e.signal)
    except (ResultsWriteError, OSError) as e:
        fail(f"--out: {e}", code=1)
    except ValueError as e:  # the results file is busy
        fail(str(e))
    _print(rows, gpu_gib, shards)
    if failed:
        fail("; ".join(failed), code=1)


def _count_all(cases, count, budget_bytes, rows, failed, table_out) -> None:
    for case in cases:
        try:
            with console.status(f"counting {escape(case.model)} U={case.unique} logits {case.logits_mode}"):
                counts = count(case)
            speedup = ideal_speedup(counts)
            mine = [
                {**counts[p].as_dict(), "ideal_speedup": round(speedup, 4) if speedup else "", "status": "ok"}
                for p in SCHEDULE_PATHS
            ]
            rows += mine
            _write(rows, table_out)  # the counts kept before the search (minutes of counts at small P)
            with console.status(f"searching the longest prompt: {escape(case.model)} logits {case.logits_mode}"):
                for row, path in zip(mine, SCHEDULE_PATHS):
                    row["longest_prompt"] = longest_prompt_search(case, path, budget_bytes, False, count)
                    row["longest_prompt_checkpointed"] = longest_prompt_search(case, path, budget_bytes, True, count)
        except ValueError as e:  # a case that fails is a row with its reason; the others go on
            failed.append(str(e))
            rows[:] = [r for r in rows if r.get("status") != "ok" or r["logits_mode"] != case.logits_mode
                       or r["unique"] != case.unique]  # fmt: skip
            rows.append({**case.__dict__, "path": "", "status": str(e)})
        _write(rows, table_out)


def _write(rows: list[dict], table_out: Optional[TableOut]) -> None:
    if table_out is None:
        return
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    table_out.write(rows, cols)


def _longest(p: int) -> str:
    """A longest-prompt cell: the search's ceiling is a lower bound, said so."""
    return f">= {p:,} (ceiling)" if p >= LONGEST_PROMPT_CEILING else f"{p:,}"


def _print(rows: list[dict], gpu_gib: float, shards: int) -> None:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    r0 = ok[0]
    table = Table(
        title=f"the prompt-once schedule: {escape(r0['model'])}, B={r0['batch']}, P={r0['prompt_len']}, "
        f"R={r0['response_len']}, budget {r0['budget']:,} tokens, {r0['dtype']}"
    )
    cols: tuple[str, ...] = (
        "logits",
        "U",
        "path",
        "waves",
        "micro-batches",
        "tokens/step",
        "largest",
        "saved GiB",
        "kept K/V GiB",
    )
    cols += ("peak GiB", "peak ckpt GiB", "PFLOP fwd+bwd", f"longest P ({gpu_gib:g} GiB)", "longest P ckpt")
    for col in cols:
        table.add_column(col, justify="left" if col in ("logits", "path") else "right")
    for r in ok:
        table.add_row(
            r["logits_mode"],
            str(r["unique"]),
            r["path"],
            str(r["waves"] or "-"),
            str(r["micro_batches"]),
            f"{r['step_tokens']:,}",
            f"{r['largest_tokens']:,}",
            f"{r['saved_bytes'] / GIB:.1f}",
            f"{r['kept_bytes'] / GIB:.2f}",
            f"{r['peak_bytes'] / GIB:.1f}",
            f"{r['peak_checkpointed_bytes'] / GIB:.1f}",
            f"{r['flops_fwd_bwd'] / 1e15:.2f}",
            _longest(r.get("longest_prompt", 0)),
            _longest(r.get("longest_prompt_checkpointed", 0)),
        )
    console.print(table)
    speedups = sorted({r["ideal_speedup"] for r in ok if r["ideal_speedup"]})
    console.print(
        "Counted on CPU (flash_cpu: what flash-attn 2 saves), a narrowed model scaled back. prompt_once: every "
        "prompt of the step in one phase 1; waves: as it runs at the budget, its first (largest) wave counted. "
        "peak: saved bytes, plus the kept keys' and values' gradients for the schedule (device bytes, offload "
        "off; the CSV's offload_* columns give waves' host bytes and device peak with it on); 'ckpt': every "
        "decoder layer checkpointed, "
        f"derived. Longest P: bisection over P on the same counts, {gpu_gib:g} GiB less weights, gradients and AdamW "
        f"state over {shards} FSDP shards (0: not even P = 1 fits; >= {LONGEST_PROMPT_CEILING:,}: the search's ceiling "
        "fits, so longer may too). Cost model: micro_batch / prompt_once FLOPs = "
        f"{', '.join(f'{s:.2f}x' for s in speedups) or 'n/a'} (prompt_once is the ideal: each prompt once per step)."
    )
