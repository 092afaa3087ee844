"""verl's engine step with and without zorro, on CPU: inference (old log-probs + entropy) and
training (verl's ppo_loss, backward), against the cost model's ideal speedup.

    .ci/verl_tests --collect-only -q >/dev/null   # once: makes the verl venv (/work/venv-verl)
    /work/venv-verl/bin/python benchmarks/verl_engine.py [--prompts 2 --responses 8 --prompt-len 512
        --response-len 64 --preset small-qwen3 --repeats 7 --out results/verl_engine.csv]

Both engines are verl 0.9.x's FSDP2 engine built by verl's own code (one gloo rank, float32, no
autocast, verl's sdpa, remove-padding off: on CPU verl's remove-padding path runs sdpa over the whole
packed row with a dense block mask, quadratic in the pack, which would flatter zorro; the padded
path is verl's fast CPU path and zorro's engine serves both the same way): `FSDPEngineWithLMHead` (baseline) and zorro's
`DedupFSDPEngine`. One micro-batch holds the whole batch (`micro_batch_size_per_gpu` = rows), so
each prompt's rows share it. Runs alternate baseline / zorro (zorro_harness.bench.arms: after one
warm-up round, the order reversed every round) and the CSV keeps every sample; the summary reports medians, p20-p80, and the speedup as the ratio of
medians with the p20-p80 range of the per-pair ratios.

Ideal (zorro_core.plan.cost): verl's forward computes logits at every token (logits mode "none"),
zorro's only where a response token is predicted; FLOPs of linear layers, attention pairs and
lm_head; training = 3 x forward. Responses have random lengths in [response_len / 2, response_len].
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys
import time
from typing import Any

from zorro_harness.bench.arms import PAIRED_COLUMNS, Benchmark, Case, Timings, Trial, main, paired_report, paired_rows
from zorro_harness.bench.measure import self_timed

PHASES = ("infer", "train")


def engine_step(engine, padded, rows: int, loss_fn, phase: str, use_remove_padding: bool) -> float:
    """Seconds of one verl engine pass over the whole batch in one micro-batch: "infer" (log-probs +
    entropy) or "train" (forward, verl's loss, backward)."""
    from zorro_core.integrations.verl.cpu import engine_batch

    data = engine_batch(
        padded,
        temperature=1.0,
        calculate_entropy=True,
        use_remove_padding=use_remove_padding,
        micro_batch_size_per_gpu=rows,
    )
    return engine_pass(engine, data, loss_fn, phase)


def engine_pass(engine, data, loss_fn, phase: str) -> float:
    """Seconds of one verl engine pass over the engine batch `data`: "infer" (log-probs + entropy) or
    "train" (forward, verl's loss, backward)."""
    t0 = time.perf_counter()
    if phase == "infer":
        with engine.eval_mode(disable_auto_offload=True):
            engine.infer_batch(data)
    else:
        engine.optimizer_zero_grad()
        with engine.train_mode(disable_auto_offload=True):
            engine.forward_backward_batch(data, loss_fn, forward_only=False)
    return time.perf_counter() - t0


def actor_checkpoint(args: argparse.Namespace, config) -> str:
    """The actor's checkpoint of `args.preset` with seed-0 random weights, saved once under /tmp (the PPO
    step benchmark reads the same one)."""
    import torch

    from zorro_core.integrations.verl.cpu import save_model
    from zorro_core.models.presets import build_model

    path = f"/tmp/zorro_verl_bench_{args.preset}"
    if not os.path.isdir(path):
        save_model(build_model(config, dtype=torch.float32, attn_implementation="sdpa", seed=0), path)
    return path


def rollout(args: argparse.Namespace, vocab: int, g) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, responses) drawn from generator `g`: `args.prompts` random prompts of `args.prompt_len`
    tokens, each with `args.responses` responses of random lengths in [response_len / 2, response_len],
    the rows shuffled as they arrive from a rollout."""
    import torch

    prompts, responses = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.responses):
            n = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(2, vocab, (n,), generator=g).tolist())
    order = torch.randperm(len(prompts), generator=g).tolist()
    return [prompts[i] for i in order], [responses[i] for i in order]


def workloads(args: argparse.Namespace, prompts: list[list[int]], responses: list[list[int]]):
    """The cost model's (plain, deduplicated) workloads of a `rollout`, its rows grouped by prompt."""
    from zorro_core.plan.cost import shape_workloads

    return shape_workloads(
        [args.prompt_len] * args.prompts,
        [args.responses] * args.prompts,
        [[len(r) for p, r in zip(prompts, responses) if tuple(p) == q] for q in dict.fromkeys(map(tuple, prompts))],
    )


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--responses", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(phase, {"phase": phase}) for phase in PHASES]


def setup(args: argparse.Namespace, cases: list[Case]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)

    from zorro_core.integrations.verl.cpu import build_engine, padded_batch, use_cpu_platform

    use_cpu_platform()
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    from zorro_core.integrations.verl.engine import DedupFSDPEngine
    from zorro_core.models.presets import preset_config
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops

    config = preset_config(args.preset)
    path = actor_checkpoint(args, config)
    g = torch.Generator().manual_seed(args.seed)
    prompts, responses = rollout(args, config.vocab_size, g)
    rows = len(prompts)
    engines = {
        "verl": build_engine(FSDPEngineWithLMHead, path, precision="fp32", use_remove_padding=False),
        "zorro": build_engine(DedupFSDPEngine, path, precision="fp32", use_remove_padding=False),
    }
    loss_fn = functools.partial(
        ppo_loss,
        config=FSDPActorConfig(
            strategy="fsdp2", rollout_n=args.responses, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=rows
        ),
    )
    shape = model_shape(config)
    base_w, dedup_w = workloads(args, prompts, responses)
    base_all = ForwardWork(base_w.tokens, base_w.attended_pairs, base_w.tokens)  # verl: logits at every token
    ideal = {
        "infer": flops(shape, base_all, "none").forward / flops(shape, dedup_w, "compute").forward,
        "train": flops(shape, base_all, "none").forward_backward / flops(shape, dedup_w, "compute").forward_backward,
    }
    padded = padded_batch(prompts, responses, seed=args.seed)
    return {"engines": engines, "padded": padded, "rows": rows, "loss_fn": loss_fn, "ideal": ideal}


def trial(ctx: dict[str, Any], case: Case, args: argparse.Namespace) -> Trial:
    def step(arm: str):
        return lambda: engine_step(
            ctx["engines"][arm], ctx["padded"], ctx["rows"], ctx["loss_fn"], case["phase"], use_remove_padding=False
        )

    return Trial({arm: step(arm) for arm in ARMS}, clock=self_timed, ideal=ctx["ideal"][case["phase"]])


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    return paired_rows(case["phase"], t, "verl", "zorro")


def meta(args: argparse.Namespace) -> dict[str, Any]:
    import datetime

    import torch
    import verl

    return {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "host": platform.node(),
        "threads": args.threads,
        "preset": args.preset,
        "shape": f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def teardown(ctx: dict[str, Any]) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}, {args.preset}, {args.threads} threads"
    )
    paired_report(rows, args)


ARMS = ("verl", "zorro")
BENCH = Benchmark(
    name="verl_engine",
    doc=__doc__ or "",
    cases=cases,
    arms=ARMS,
    setup=setup,
    trial=trial,
    rows=rows,
    teardown=teardown,
    arguments=arguments,
    quick={"responses": 2, "prompt_len": 16, "response_len": 8, "rounds": 1, "threads": 1},
    rounds=5,
    out="results/verl_engine.csv",
    columns=PAIRED_COLUMNS,
    meta=meta,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
