"""flash_cpu (the gather-free GPU path's code on CPU) against sdpa (the CPU default), a benchmark.

    PYTHONPATH=. python benchmarks/flash_cpu_speed.py [--repeats 7] [--out results/flash_cpu_speed.csv]

The quick suite's shapes (small-qwen3, float32, B=8, R=32, P=128/384, U=1/2/4/8), forward+backward
of the deduplicated actor and of the packed baseline, each on both backends, the four arms
interleaved by the harness's timer (zorro_harness.bench.arms, order reversed every round). Per
case: the paired ratio sdpa time / flash_cpu time (> 1: flash_cpu faster), median [p20, p80] of
the rounds, for dedup and for the baseline. One torch thread.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, Timings, Trial, main

BACKENDS = ("sdpa", "flash_cpu")
KINDS = ("dedup", "baseline")


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 384])
    ap.add_argument("--unique", type=int, nargs="+", default=[1, 2, 4, 8], help="unique prompts of the 8 rows")


def cases(args: argparse.Namespace) -> list[Case]:
    return [
        Case(f"b8u{u}p{p}r32", {"case": f"b8u{u}p{p}r32"}, {"unique": u, "prompt_len": p})
        for p in args.prompt_lens
        for u in args.unique
    ]


def setup(args: argparse.Namespace, cases: list[Case]) -> Any:
    import torch

    from zorro_core.models.presets import build_model, preset_config

    torch.set_num_threads(1)
    return build_model(preset_config("small-qwen3"), dtype=torch.float32, seed=0)


def trial(model: Any, case: Case, args: argparse.Namespace) -> Trial:
    from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch

    batch = create_dummy_batch(
        batch_size=8,
        num_unique_prompts=case["unique"],
        prompt_len=case["prompt_len"],
        response_len=32,
        vocab_size=model.config.vocab_size,
    )

    def step(actor: Any):
        def run() -> None:
            actor.forward(batch).log_probs.sum().backward()

        return run

    arms = {}
    for be in BACKENDS:
        arms[f"dedup_{be}"] = step(DeduplicatedActor(model=model, varlen_backend=be))
        arms[f"baseline_{be}"] = step(BaselineActor(model=model, varlen_backend=be))
    return Trial(arms, between=lambda: model.zero_grad(set_to_none=True))


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    row: dict[str, Any] = {"case": case.id}
    for kind in KINDS:
        sp = t.speedup(f"{kind}_sdpa", f"{kind}_flash_cpu")
        for be in BACKENDS:
            row[f"{kind}_{be}_ms"] = round(t.median_ms(f"{kind}_{be}"), 1)
        row[f"{kind}_sdpa_over_flash_cpu"] = round(sp.value, 3)
        row[f"{kind}_p20"], row[f"{kind}_p80"] = round(sp.p20, 3), round(sp.p80, 3)
    return [row]


BENCH = Benchmark(
    name="flash_cpu_speed",
    doc=__doc__ or "",
    cases=cases,
    arms=tuple(f"{k}_{b}" for b in BACKENDS for k in KINDS),
    setup=setup,
    trial=trial,
    rows=rows,
    arguments=arguments,
    quick={"prompt_lens": [32], "unique": [1, 8], "rounds": 1, "warmup": 0},
    warmup=2,
    rounds=7,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
