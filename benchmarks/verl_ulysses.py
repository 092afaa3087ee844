"""verl's engine step under Ulysses sequence parallelism (SP=2 on 2 gloo ranks), with and without
zorro, on CPU: inference (old log-probs + entropy) and training (verl's ppo_loss, backward),
against the cost model's ideal speedup.

    PYTHONPATH=. /work/main/.venv-verl/bin/python benchmarks/verl_ulysses.py [--prompts 2 --responses 8
        --prompt-len 256 --response-len 32 --preset small-qwen3 --repeats 5 --out results/verl_ulysses.csv]

Both arms are verl 0.9.x's FSDP2 engine built by verl's own code with
`ulysses_sequence_parallel_size=2` (float32, no autocast, sdpa, remove-padding on, as verl requires
under SP), each rank one thread, both ranks holding the whole batch (data-parallel size 1):
`FSDPEngineWithLMHead` and zorro's `DedupFSDPEngine`. What the baseline arm computes is not verl's
GPU computation: verl's Ulysses patch wraps flash attention only, so with sdpa on CPU each rank's
attention covers its own slice of the packed row (tokens of the other slice are never attended, no
all-to-all runs), which is less work than the real thing; its time is a lower bound of verl's SP
step here and the speedup an underestimate. zorro's arm is exact (tests/integrations/verl/test_integrations_verl_ulysses.py).
One micro-batch holds the whole batch. Runs alternate baseline / zorro after one warm-up round
(zorro_harness.bench.arms.time_arms inside the ranks, the order reversed every round); times are
rank 0's (the ranks wait for each other in every collective).

Ideal (zorro_core.plan.cost): as benchmarks/verl_engine.py (verl computes logits at every token,
zorro only where a response token is predicted; training = 3 x forward); SP divides both arms'
work by the same 2, so the ideal is the single-rank one.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verl_engine import engine_step  # noqa: E402  (verl is imported inside it, when it runs)

from zorro_harness.bench.arms import (  # noqa: E402
    PAIRED_COLUMNS,
    Benchmark,
    Case,
    Timings,
    main,
    paired_report,
    paired_rows,
    time_arms,
)
from zorro_harness.bench.measure import self_timed  # noqa: E402

PHASES = ("infer", "train")
ARMS = ("verl", "zorro")


def make_rows(vocab: int, args) -> tuple[list[list[int]], list[list[int]]]:
    import torch

    g = torch.Generator().manual_seed(args.seed)
    prompts, responses = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.responses):
            n = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(2, vocab, (n,), generator=g).tolist())
    order = torch.randperm(len(prompts), generator=g).tolist()  # rows arrive shuffled
    return [prompts[i] for i in order], [responses[i] for i in order]


def rank_main(path: str, args, phases: list[str]) -> dict:
    from zorro_core.integrations.verl.cpu import build_engine, padded_batch, use_cpu_platform

    use_cpu_platform()
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    from zorro_core.integrations.verl.engine import DedupFSDPEngine
    from zorro_core.models.presets import preset_config

    prompts, responses = make_rows(preset_config(args.preset).vocab_size, args)
    padded = padded_batch(prompts, responses, seed=args.seed)
    rows = len(prompts)
    engines = {
        name: build_engine(cls, path, precision="fp32", use_remove_padding=True, ulysses_sequence_parallel_size=2)
        for name, cls in (("verl", FSDPEngineWithLMHead), ("zorro", DedupFSDPEngine))
    }
    loss_fn = functools.partial(
        ppo_loss,
        config=FSDPActorConfig(
            strategy="fsdp2", rollout_n=args.responses, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=rows
        ),
    )

    def step(arm: str, phase: str):
        return lambda: engine_step(engines[arm], padded, rows, loss_fn, phase, use_remove_padding=True)

    return {
        phase: dict(
            time_arms({arm: step(arm, phase) for arm in ARMS}, args.rounds, args.warmup, clock=self_timed).samples
        )
        for phase in phases
    }


def ideal_speedups(config, prompts, responses, args) -> dict[str, float]:
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops, shape_workloads

    shape = model_shape(config)
    base_w, dedup_w = shape_workloads(
        [args.prompt_len] * args.prompts,
        [args.responses] * args.prompts,
        [[len(r) for p, r in zip(prompts, responses) if tuple(p) == q] for q in dict.fromkeys(map(tuple, prompts))],
    )
    base_all = ForwardWork(base_w.tokens, base_w.attended_pairs, base_w.tokens)  # verl: logits at every token
    return {
        "infer": flops(shape, base_all, "none").forward / flops(shape, dedup_w, "compute").forward,
        "train": flops(shape, base_all, "none").forward_backward / flops(shape, dedup_w, "compute").forward_backward,
    }


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--responses", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(phase, {"phase": phase}) for phase in PHASES]


def setup(args: argparse.Namespace, cases: list[Case]) -> dict[str, Any]:
    """Both ranks time every selected phase in one launch (the engines are built once)."""
    import torch

    from zorro_core.distributed.launch import launch
    from zorro_core.integrations.verl.cpu import save_model
    from zorro_core.models.presets import build_model, preset_config

    config = preset_config(args.preset)
    path = f"/tmp/zorro_verl_bench_{args.preset}"
    if not os.path.isdir(path):
        save_model(build_model(config, dtype=torch.float32, attn_implementation="sdpa", seed=0), path)
    samples = launch(rank_main, 2, path, args, [c["phase"] for c in cases], threads=1, timeout_s=3000)[0]
    prompts, responses = make_rows(config.vocab_size, args)
    return {"samples": samples, "ideal": ideal_speedups(config, prompts, responses, args)}


def compute(ctx: dict[str, Any], case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    phase = case["phase"]
    return paired_rows(phase, Timings(ctx["samples"][phase], ctx["ideal"][phase]), "verl", "zorro", efficiency=False)


def meta(args: argparse.Namespace) -> dict[str, Any]:
    import datetime

    import torch
    import verl

    return {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "host": platform.node(),
        "ranks": "2 (SP=2, DP=1), 1 thread each",
        "preset": args.preset,
        "shape": f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"Ulysses SP=2 on 2 ranks, {args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}, {args.preset}"
    )
    paired_report(rows, args)


BENCH = Benchmark(
    name="verl_ulysses",
    doc=__doc__ or "",
    cases=cases,
    arms=ARMS,
    setup=setup,
    compute=compute,
    arguments=arguments,
    quick={"responses": 2, "prompt_len": 16, "response_len": 8, "rounds": 1},
    rounds=5,
    out="results/verl_ulysses.csv",
    columns=PAIRED_COLUMNS,
    meta=meta,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
