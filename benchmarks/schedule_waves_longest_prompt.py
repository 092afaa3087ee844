#!/usr/bin/env python
"""The waves path of `zorro bench memory --budget` at Qwen3-8B, G=16, R=8K, budget 27,306: counted at two
prompt lengths of one layout (one wave, 2 phase-1 calls, 6 micro-batches of 3 responses), each count
affine in P there (as bench memory's search reads it); the longest prompt then follows the line with
the phase-3 term at each P's own phase-1 calls (the only term that changes with the call count).

    PYTHONPATH=. python benchmarks/schedule_waves_longest_prompt.py compute,memory results/memory_schedule_waves_qwen3_8b.csv
    # ~5 min on 2 loaded cores
"""

import csv
import dataclasses
import json
import sys

from zorro_harness.bench import schedule_memory as sm
from zorro_harness.bench.memory import parameter_bytes


def main():
    GIB = 1024**3
    model = "Qwen/Qwen3-8B"
    limit = 141 * GIB - parameter_bytes(model) / 8
    out = []
    for mode in sys.argv[1].split(","):
        counts = [
            sm.count_schedule_isolated(
                sm.ScheduleCase(model, 16, p, 8192, 1, 27306, mode, "bfloat16", 1, 8), ("waves",)
            )[0]
            for p in (32768, 40960)
        ]
        a, b = counts

        def peak(p):
            c = sm.at_prompt_len(a, b, p)
            calls = -(-p // 27306)
            c = dataclasses.replace(c, chunk_tokens=-(-p // calls))
            return c.peak_checkpointed

        lo, hi = 1, 1 << 22
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if peak(mid) <= limit else (lo, mid)
        row = {
            **a.as_dict(),
            "longest_prompt_checkpointed_derived": lo,
            "peak_ckpt_at_40960": round(b.peak_checkpointed),
        }
        print(
            json.dumps(
                {
                    k: row[k]
                    for k in (
                        "logits_mode",
                        "peak_checkpointed_bytes",
                        "peak_ckpt_at_40960",
                        "kept_bytes",
                        "longest_prompt_checkpointed_derived",
                    )
                }
            ),
            flush=True,
        )
        out.append(row)
    with open(sys.argv[2], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(out)


if __name__ == "__main__":
    main()
