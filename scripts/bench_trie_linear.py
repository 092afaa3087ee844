"""sharing="prefix" vs "prompt" through gated DeltaNet layers on a shared-system-prompt batch.

Three arms timed interleaved in one process (packed baseline, sharing="prompt", sharing="prefix"),
forward and forward+backward, one thread; medians with the min-max spread, and the cost model's
ideal speedups (zorro_core.plan.cost, linear-attention layers and replayed tails counted) beside
them. Default: small-qwen3-next, float32, CPU, 8 groups x 4 responses sharing a 512-token system
prompt, distinct 64-token user turns, 64-token responses.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/bench_trie_linear.py [--repeats 7] [--model small-qwen3-next]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.models.presets import build_model, preset_config
from zorro_core.models.registry import model_shape
from zorro_core.plan.build import build_dedup_plan, build_plain_plan
from zorro_core.plan.cost import compare_plans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-qwen3-next")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--system", type=int, default=512)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--ideal-only", action="store_true", help="print the cost model's ideals, time nothing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = preset_config(args.model)
    model = build_model(config, dtype=torch.float32, attn_implementation="sdpa")
    batch = create_dummy_batch(
        batch_size=args.groups * args.responses,
        num_unique_prompts=args.groups,
        prompt_len=args.system + args.user,
        response_len=args.response_len,
        vocab_size=config.vocab_size,
        shared_prefix_len=args.system,
        seed=0,
    )
    arms = {
        "baseline": BaselineActor(model=model),
        "prompt": DeduplicatedActor(model=model, sharing="prompt"),
        "prefix": DeduplicatedActor(model=model, sharing="prefix"),
    }
    shape = model_shape(config)
    plans = {
        "baseline": build_plain_plan(batch),
        "prompt": build_dedup_plan(batch, sharing="prompt"),
        "prefix": build_dedup_plan(batch, sharing="prefix"),
    }
    print(
        f"{args.model}: {batch.batch_size} rows, tokens per arm: "
        + ", ".join(f"{k} {p.num_tokens}" for k, p in plans.items())
    )
    if args.ideal_only:
        for phase in ("forward", "forward_backward"):
            for num, den in (("baseline", "prompt"), ("baseline", "prefix"), ("prompt", "prefix")):
                ideal = compare_plans(shape, plans[num], plans[den]).ideal_speedup(phase)
                print(f"{phase}: {den} vs {num} ideal {ideal:.2f}x")
        return

    def run(actor, phase: str) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if phase == "forward":
            with torch.no_grad():
                actor.forward(batch)
        else:
            out = actor.forward(batch)
            out.log_probs.sum().backward()
        return time.perf_counter() - t0

    for phase in ("forward", "forward_backward"):
        times: dict[str, list[float]] = {k: [] for k in arms}
        for i in range(args.warmup + args.repeats):
            for name, actor in arms.items():  # interleaved: the arms see the same machine load
                t = run(actor, phase)
                if i >= args.warmup:
                    times[name].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"\n{phase} ({args.repeats} repeats, median [min, max] s)")
        for k, v in times.items():
            print(f"  {k:9s} {med[k]:.3f} [{min(v):.3f}, {max(v):.3f}]")
        for num, den in (("baseline", "prompt"), ("baseline", "prefix"), ("prompt", "prefix")):
            ratios = sorted(a / b for a, b in zip(times[num], times[den]))
            ideal = compare_plans(shape, plans[num], plans[den]).ideal_speedup(phase)
            print(
                f"  {den} vs {num}: {med[num] / med[den]:.2f}x (per-repeat ratios {ratios[0]:.2f}-{ratios[-1]:.2f}), "
                f"ideal {ideal:.2f}x"
            )


if __name__ == "__main__":
    main()
