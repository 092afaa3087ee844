"""flash_cpu (the gather-free GPU path's code on CPU) against sdpa (the CPU default), a benchmark.

    PYTHONPATH=. python benchmarks/flash_cpu_speed.py [--repeats 7] [--out results/flash_cpu_speed.csv]

The quick suite's shapes (small-qwen3, float32, B=8, R=32, P=128/384, U=1/2/4/8), forward+backward
of the deduplicated actor and of the packed baseline, each on both backends, the four arms
interleaved by the harness's timer (zorro_harness.bench.measure.time_interleaved, order reversed
every round). Per case: the paired ratio sdpa time / flash_cpu time (> 1: flash_cpu faster), median
[p20, p80] of the rounds, for dedup and for the baseline. One torch thread.
"""

from __future__ import annotations

import argparse
import csv
import sys

import torch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.models.presets import build_model, preset_config
from zorro_harness.bench.measure import speedup, time_interleaved

BACKENDS = ("sdpa", "flash_cpu")


def step(actor, batch):
    def run():
        out = actor.forward(batch)
        out.log_probs.sum().backward()

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_model(preset_config("small-qwen3"), dtype=torch.float32, seed=0)
    rows = []
    for p in (128, 384):
        for u in (1, 2, 4, 8):
            batch = create_dummy_batch(
                batch_size=8, num_unique_prompts=u, prompt_len=p, response_len=32, vocab_size=model.config.vocab_size
            )
            arms = {}
            for be in BACKENDS:
                arms[f"dedup_{be}"] = step(DeduplicatedActor(model=model, varlen_backend=be), batch)
                arms[f"baseline_{be}"] = step(BaselineActor(model=model, varlen_backend=be), batch)
            times = time_interleaved(
                arms, "cpu", warmup=2, repeats=args.repeats, between=lambda: model.zero_grad(set_to_none=True)
            )
            row = {"case": f"b8u{u}p{p}r32"}
            for kind in ("dedup", "baseline"):
                sp = speedup(times[f"{kind}_sdpa"], times[f"{kind}_flash_cpu"])
                row[f"{kind}_sdpa_ms"] = round(sorted(times[f"{kind}_sdpa"])[len(times[f"{kind}_sdpa"]) // 2], 1)
                row[f"{kind}_flash_cpu_ms"] = round(
                    sorted(times[f"{kind}_flash_cpu"])[len(times[f"{kind}_flash_cpu"]) // 2], 1
                )
                row[f"{kind}_sdpa_over_flash_cpu"] = round(sp.value, 3)
                row[f"{kind}_p20"], row[f"{kind}_p80"] = round(sp.p20, 3), round(sp.p80, 3)
            rows.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
