"""verl's PPO step with a critic (GAE) with and without zorro, on CPU: the actor's and critic's engine passes
of one step, against the cost model's ideal speedup.

    .ci/verl_tests --collect-only -q >/dev/null   # once: makes the verl venv (or VERL_VENV=/work/venvs/verl)
    PYTHONPATH=. <verl venv>/bin/python benchmarks/verl_ppo_step.py [--prompts 2 --responses 4
        --prompt-len 512 --response-len 64 --preset small-qwen3 --rounds 5 --out results/verl_ppo_step.csv]

The engines are verl 0.9.x's FSDP2 engines built by verl's own code (one gloo rank, float32, no autocast,
verl's sdpa, remove-padding off: verl's fast CPU path, see benchmarks/verl_engine.py): the actor
`FSDPEngineWithLMHead` and critic `FSDPEngineWithValueHead` (baseline) against zorro's `DedupFSDPEngine`
and `DedupValueEngine`, the critic a `Qwen3ForTokenClassification` of the same shape as verl loads it. One
micro-batch holds the whole batch, so each prompt's rows share it. Cases, each a sequence of verl's engine
calls on one rollout batch:

- "critic_infer": the critic's values (the trainer's `_compute_values`);
- "critic_train": the critic's update, verl's `value_loss` and backward (`_update_critic`);
- "ppo_step": the whole step's engine work in the trainer's order: old log-probs + entropy and reference
  log-probs (the actor engine twice, as verl's `ref_in_actor`), the critic's values, the critic's update,
  the actor's update (verl's `ppo_loss`, backward). The optimizer steps, GAE and the rollout are left out
  (the same on both arms).

Runs alternate baseline / zorro (zorro_harness.bench.arms: one warm-up round, then the order reversed every
round); the CSV keeps every sample, the summary medians, p20-p80, and the speedup as the ratio of medians
with the p20-p80 range of the per-pair ratios. A zorro arm any of whose passes fell back to verl's forward
is refused.

Ideal (zorro_core.plan.cost): FLOPs of the same passes; verl's actor computes logits at every token (logits
mode "none"), zorro's only where a response token is predicted; the critics compute no logits (the value
head, hidden x 1, is left out of both); training = 3 x forward. Responses have random lengths in
[response_len / 2, response_len].
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))

# The run's metadata, printed summary, teardown, actor checkpoint, rollout and workloads are the actor
# engine benchmark's (its sibling script).
from verl_engine import actor_checkpoint, meta, report, rollout, teardown, workloads  # noqa: E402

from zorro_harness.bench.arms import PAIRED_COLUMNS, Benchmark, Case, Timings, Trial, main, paired_rows  # noqa: E402
from zorro_harness.bench.measure import self_timed  # noqa: E402

CASES = ("critic_infer", "critic_train", "ppo_step")
STEP = ("old_log_prob", "ref_log_prob", "values", "update_critic", "update_actor")
"""The engine calls of one PPO step, in the trainer's order."""
PARTS = {"critic_infer": ("values",), "critic_train": ("update_critic",), "ppo_step": STEP}
ARMS = ("verl", "zorro")


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(name, {"case": name}) for name in CASES]


def _models(args: argparse.Namespace, config) -> tuple[str, str]:
    import torch
    from transformers import AutoModelForTokenClassification

    from zorro_core.integrations.verl.cpu import save_model

    actor = actor_checkpoint(args, config)
    critic = f"/tmp/zorro_verl_bench_{args.preset}_critic"
    if not os.path.isdir(critic):
        config.num_labels = 1
        torch.manual_seed(0)
        model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
        save_model(model, critic)
    return actor, critic


def setup(args: argparse.Namespace, cases: list[Case]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)

    from zorro_core.integrations.verl.cpu import build_engine, padded_batch, use_cpu_platform

    use_cpu_platform()
    from verl.workers.config import FSDPActorConfig, FSDPCriticConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
    from verl.workers.utils.losses import ppo_loss, value_loss

    from zorro_core.integrations.verl.critic import DedupValueEngine
    from zorro_core.integrations.verl.engine import DedupFSDPEngine
    from zorro_core.models.presets import preset_config
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops

    config = preset_config(args.preset)
    actor_path, critic_path = _models(args, preset_config(args.preset))
    g = torch.Generator().manual_seed(args.seed)
    prompts, responses = rollout(args, config.vocab_size, g)
    rows = len(prompts)
    padded = padded_batch(prompts, responses, seed=args.seed)
    mask = padded["response_mask"]
    padded["values"] = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    padded["returns"] = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask

    def engine(cls, path: str, model_type: str):
        return build_engine(cls, path, precision="fp32", use_remove_padding=False, model_type=model_type)

    engines = {
        "verl": (
            engine(FSDPEngineWithLMHead, actor_path, "language_model"),
            engine(FSDPEngineWithValueHead, critic_path, "value_model"),
        ),
        "zorro": (
            engine(DedupFSDPEngine, actor_path, "language_model"),
            engine(DedupValueEngine, critic_path, "value_model"),
        ),
    }
    losses = {
        "actor": functools.partial(
            ppo_loss,
            config=FSDPActorConfig(
                strategy="fsdp2", rollout_n=args.responses, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=rows
            ),
        ),
        "critic": functools.partial(
            value_loss,
            config=FSDPCriticConfig(
                strategy="fsdp2", rollout_n=args.responses, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=rows
            ),
        ),
    }
    shape = model_shape(config)
    base_w, dedup_w = workloads(args, prompts, responses)
    actor_plain = flops(shape, ForwardWork(base_w.tokens, base_w.attended_pairs, base_w.tokens), "none")
    actor_dedup = flops(shape, dedup_w, "compute")
    critic_plain = flops(shape, ForwardWork(base_w.tokens, base_w.attended_pairs, 0), "none")
    critic_dedup = flops(shape, ForwardWork(dedup_w.tokens, dedup_w.attended_pairs, 0), "none")
    cost = {
        "old_log_prob": (actor_plain.forward, actor_dedup.forward),
        "ref_log_prob": (actor_plain.forward, actor_dedup.forward),
        "values": (critic_plain.forward, critic_dedup.forward),
        "update_critic": (critic_plain.forward_backward, critic_dedup.forward_backward),
        "update_actor": (actor_plain.forward_backward, actor_dedup.forward_backward),
    }
    ideal = {name: sum(cost[p][0] for p in parts) / sum(cost[p][1] for p in parts) for name, parts in PARTS.items()}
    return {"engines": engines, "padded": padded, "rows": rows, "losses": losses, "ideal": ideal}


def _call(ctx: dict[str, Any], arm: str, part: str) -> None:
    from zorro_core.integrations.verl.cpu import engine_batch

    actor, critic = ctx["engines"][arm]
    on_critic = part in ("values", "update_critic")
    data = engine_batch(
        ctx["padded"],
        temperature=1.0,
        calculate_entropy=part in ("old_log_prob", "update_actor"),
        use_remove_padding=False,
        micro_batch_size_per_gpu=ctx["rows"],
    )
    engine = critic if on_critic else actor
    if part in ("old_log_prob", "ref_log_prob", "values"):
        with engine.eval_mode(disable_auto_offload=True):
            engine.infer_batch(data)
    else:
        engine.optimizer_zero_grad()
        with engine.train_mode(disable_auto_offload=True):
            engine.forward_backward_batch(data, ctx["losses"]["critic" if on_critic else "actor"], forward_only=False)


def trial(ctx: dict[str, Any], case: Case, args: argparse.Namespace) -> Trial:
    def step(arm: str):
        def run() -> float:
            t0 = time.perf_counter()
            for part in PARTS[case["case"]]:
                _call(ctx, arm, part)
            return time.perf_counter() - t0

        return run

    return Trial(
        {arm: step(arm) for arm in ARMS},
        clock=self_timed,
        ideal=ctx["ideal"][case["case"]],
        notes={"zorro": ctx["engines"]["zorro"]},
    )


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    for engine in t.notes["zorro"]:
        if engine.zorro_calls["fallback"]:  # the zorro arm would have timed verl's own forward
            raise RuntimeError(f"{type(engine).__name__} fell back to verl's forward: {engine.zorro_calls}")
    return paired_rows(case["case"], t, "verl", "zorro")


BENCH = Benchmark(
    name="verl_ppo_step",
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
    out="results/verl_ppo_step.csv",
    columns=PAIRED_COLUMNS,
    meta=meta,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
