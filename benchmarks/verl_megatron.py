"""verl's Megatron engine step with and without zorro on CPU at tensor parallel 2 (2 gloo ranks):
inference (old log-probs + entropy) and the actor update's forward-backward (verl's ppo_loss),
against the cost model's ideal.

    .ci/verl_megatron_tests --collect-only -q >/dev/null   # once: makes the venv (.venv-verl-megatron)
    .venv-verl-megatron/bin/python benchmarks/verl_megatron.py [--prompts 2 --responses 8 --prompt-len 256
        --response-len 32 --preset small-qwen3 --rounds 5 --out results/verl_megatron.csv]

Both engines are verl 0.9.1's `MegatronEngineWithLMHead` built by verl's own code on mbridge's path
(zorro_core.integrations.verl.cpu_megatron: megatron's local layers, float32, THD): verl's own and
zorro's `DedupMegatronEngine`. On CPU both run zorro's reference attention (verl's as the stand-in for
TransformerEngine's THD kernel, each row causal over itself; zorro's over its plan), so the comparison
is of the work each computes. One micro-batch holds the whole batch. Each round runs verl then zorro,
the order reversed every other round, after one warm-up round; a pass's time is the slower rank's.
The CSV keeps every sample; the summary gives medians, p20-p80 and the speedup as the ratio of medians
with the p20-p80 range of the per-round ratios.

Ideal (zorro_core.plan.cost): both engines compute logits at every token they run (verl at every row
token, zorro at every packed token: logits mode "none" for both); FLOPs of linear layers, attention
pairs and lm_head; training = 3 x forward.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import statistics
import sys
from typing import Any

PHASES = ("infer", "train")


def _rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from verl.workers.config import McoreActorConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    from zorro_core.integrations.verl.cpu import engine_batch, padded_batch
    from zorro_core.integrations.verl.cpu_megatron import build_megatron_engine
    from zorro_core.integrations.verl.megatron_engine import DedupMegatronEngine
    from zorro_core.models.presets import preset_config

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from verl_engine import actor_checkpoint, engine_pass, rollout

    torch.set_num_threads(args.threads)
    config = preset_config(args.preset)
    path = actor_checkpoint(args, config)
    prompts, responses = rollout(args, config.vocab_size, torch.Generator().manual_seed(args.seed))
    rows = len(prompts)
    build = functools.partial(build_megatron_engine, tensor_parallel=args.tp, precision="float32")
    engines = {"verl": build(MegatronEngineWithLMHead, path), "zorro": build(DedupMegatronEngine, path)}
    loss_fn = functools.partial(
        ppo_loss,
        config=McoreActorConfig(rollout_n=args.responses, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=rows),
    )
    padded = padded_batch(prompts, responses, seed=args.seed)

    def step(arm: str, phase: str) -> float:
        engine = engines[arm]
        data = engine_batch(
            padded, temperature=1.0, calculate_entropy=True, use_remove_padding=True, micro_batch_size_per_gpu=rows
        )
        dist.barrier()
        seconds = torch.tensor(engine_pass(engine, data, loss_fn, phase), dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds)

    samples = []
    for phase in PHASES:
        for arm in ("verl", "zorro"):
            step(arm, phase)  # warm-up
        for r in range(args.rounds):
            order = ("verl", "zorro") if r % 2 == 0 else ("zorro", "verl")
            times = {arm: step(arm, phase) for arm in order}
            samples.append({"phase": phase, "round": r, "verl_s": times["verl"], "zorro_s": times["zorro"]})
    return samples


def _ideal(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from zorro_core.models.presets import preset_config
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from verl_engine import rollout, workloads

    config = preset_config(args.preset)
    prompts, responses = rollout(args, config.vocab_size, torch.Generator().manual_seed(args.seed))
    base, dedup = workloads(args, prompts, responses)
    shape = model_shape(config)
    base_all = ForwardWork(base.tokens, base.attended_pairs, base.tokens)
    dedup_all = ForwardWork(dedup.tokens, dedup.attended_pairs, dedup.tokens)
    b, d = flops(shape, base_all, "none"), flops(shape, dedup_all, "none")
    return {"infer": b.forward / d.forward, "train": b.forward_backward / d.forward_backward}


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--responses", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/verl_megatron.csv")
    args = ap.parse_args(argv)

    from zorro_core.distributed.launch import launch

    samples = launch(_rank, args.tp, args, threads=args.threads, timeout_s=1800)[0]
    ideal = _ideal(args)
    print(
        f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}, {args.preset}, "
        f"TP={args.tp} on {args.tp} gloo ranks, {args.threads} thread(s) each"
    )
    for phase in PHASES:
        s = [x for x in samples if x["phase"] == phase]
        v, z = [x["verl_s"] for x in s], [x["zorro_s"] for x in s]
        ratios = [a / b for a, b in zip(v, z)]
        print(
            f"{phase}: verl {statistics.median(v):.3f}s (p20-p80 {_quantile(v, 0.2):.3f}-{_quantile(v, 0.8):.3f}), "
            f"zorro {statistics.median(z):.3f}s (p20-p80 {_quantile(z, 0.2):.3f}-{_quantile(z, 0.8):.3f}), "
            f"speedup {statistics.median(v) / statistics.median(z):.2f}x "
            f"(per-round p20-p80 {_quantile(ratios, 0.2):.2f}-{_quantile(ratios, 0.8):.2f}), ideal {ideal[phase]:.2f}x"
        )
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["phase", "round", "verl_s", "zorro_s", "ideal"])
            w.writeheader()
            for x in samples:
                w.writerow({**x, "ideal": round(ideal[x["phase"]], 4)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
