"""The `waves` path of `zorro bench memory --budget` at Qwen3-8B, G=16, R=8K, budget 27,306 (docs/schedule.md).

Counted at two prompt lengths of one layout (one wave, 2 phase-1 calls, 6 micro-batches of 3
responses), where each count is affine in P (as bench memory's search reads it). The longest prompt
that fits 141 GiB (checkpointed; weights, gradients and AdamW state over 8 FSDP shards) then follows
that line, with the phase-3 term at each P's own phase-1 calls (the only term the call count changes).

    PYTHONPATH=. python benchmarks/schedule_waves_longest_prompt.py compute,memory results/memory_schedule_waves_qwen3_8b.csv
    # ~5 min on 2 loaded cores
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys

MODEL = "Qwen/Qwen3-8B"
BUDGET = 27306
GIB = 1024**3


def peak_at(a, b, p: int, offload: bool = False) -> float:
    """The checkpointed device peak at prompt length p on the line through counts a and b (offload: with
    phase 1's offloadable saves on the host)."""
    from zorro_harness.bench import schedule_memory as sm

    c = sm.at_prompt_len(a, b, p)
    calls = -(-p // BUDGET)
    c = dataclasses.replace(c, chunk_tokens=-(-p // calls))
    return c.peak_checkpointed - (c.host_checkpointed if offload else 0.0)


def longest(a, b, limit: float, offload: bool) -> int:
    lo, hi = 1, 1 << 22
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak_at(a, b, mid, offload) <= limit else (lo, mid)
    return lo


def main() -> None:
    from zorro_harness.bench import schedule_memory as sm
    from zorro_harness.bench.memory import parameter_bytes

    limit = 141 * GIB - parameter_bytes(MODEL) / 8
    out = []
    for mode in sys.argv[1].split(","):
        a, b = (
            sm.count_schedule_isolated(
                sm.ScheduleCase(MODEL, 16, p, 8192, 1, BUDGET, mode, "bfloat16", 1, 8), ("waves",)
            )[0]
            for p in (32768, 40960)
        )
        row = {
            **a.as_dict(),
            "longest_prompt_checkpointed_derived": longest(a, b, limit, False),
            "longest_prompt_checkpointed_offload_derived": longest(a, b, limit, True),
            "peak_ckpt_at_40960": round(b.peak_checkpointed),
        }
        keys = ("logits_mode", "peak_checkpointed_bytes", "peak_ckpt_at_40960", "kept_bytes", "offload_host_bytes")
        keys += ("offload_peak_bytes", "offload_host_checkpointed_bytes", "longest_prompt_checkpointed_derived")
        print(json.dumps({k: row[k] for k in (*keys, "longest_prompt_checkpointed_offload_derived")}), flush=True)
        out.append(row)
    with open(sys.argv[2], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)


if __name__ == "__main__":
    main()
