"""OpenRLHF's PPO critic forward (+ backward) with and without zorro (`serve_critic`), on CPU, against the cost
model's ideal speedup.

    .ci/openrlhf_tests --collect-only -q >/dev/null   # once: makes the OpenRLHF venv (.venv-openrlhf)
    DS_ACCELERATOR=cpu PYTHONPATH=. .venv-openrlhf/bin/python benchmarks/openrlhf_critic.py [--prompts 2
        --responses 4 --prompt-len 512 --response-len 64 --preset small-qwen3 --rounds 5
        --out results/openrlhf_critic.csv]

Both arms are built by OpenRLHF's `get_llm_for_sequence_regression(path, "critic")` from the same checkpoint
(float32, sdpa, `--packing off` by default: the padded path, OpenRLHF's faster one on CPU; `--packing on`:
its `packing_samples`), the same value head; the micro-batch by OpenRLHF's own Experience batching (prompt +
response per row, right-padded; siblings adjacent, as the rollout delivers them). Phases: "infer" is the
value call of `CriticModelActor.forward` (no grad), "train" the call of `CriticPPOTrainer.training_step`
(`return_output=True`) plus the backward of the summed values. Runs alternate OpenRLHF / zorro after one warm-up round (zorro_harness.bench.arms,
the order reversed every round); the CSV keeps every
sample, the summary medians, p20-p80, and the speedup as the ratio of medians with the p20-p80 range of
the per-pair ratios.

Ideal (zorro_core.plan.cost): the base model's forward over every row's tokens against each prompt once; no
logits on either side (the value head, hidden x 1, is left out of both); training = 3 x forward. Responses have random lengths
in [response_len / 2, response_len].
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# The run's metadata, printed summary, rollout and workloads are the actor benchmark's (its sibling script,
# on sys.path[0]).
import openrlhf_actor  # noqa: E402
from openrlhf_actor import meta, report, rollout, workloads  # noqa: E402

from zorro_harness.bench.arms import (  # noqa: E402
    PAIRED_COLUMNS,
    Benchmark,
    Case,
    Timings,
    Trial,
    main,
    paired_rows,
)
from zorro_harness.bench.measure import self_timed  # noqa: E402

PHASES = ("infer", "train")
ARMS = ("openrlhf", "zorro")


def arguments(ap: argparse.ArgumentParser) -> None:
    openrlhf_actor.arguments(ap, packing="off")


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(phase, {"phase": phase}) for phase in PHASES]


def setup(args: argparse.Namespace, cases: list[Case]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)

    import openrlhf_setup  # the flash-attn stand-in on sys.path before OpenRLHF imports
    from openrlhf.models import get_llm_for_sequence_regression

    from zorro_core.integrations.openrlhf.critic import serve_critic
    from zorro_core.models.presets import preset_config
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops

    path = openrlhf_setup.save_tiny(f"/tmp/zorro_openrlhf_bench_{args.preset}", preset=args.preset)

    def critic(packed: bool):
        torch.manual_seed(args.seed)  # the value head OpenRLHF initialises: the same in both arms
        model = get_llm_for_sequence_regression(
            path, "critic", param_dtype="bf16", attn_implementation="sdpa", packing_samples=packed
        )
        return model.to(torch.float32)

    config = preset_config(args.preset)
    pairs = rollout(args, config.vocab_size)
    seq, att, act = openrlhf_setup.right_padded(pairs)
    packed = args.packing == "on"
    actors = {"openrlhf": critic(packed), "zorro": serve_critic(critic(packed))}
    shape = model_shape(config)
    base_w, dedup_w = workloads(args, pairs)
    plain = ForwardWork(base_w.tokens, base_w.attended_pairs, 0)  # no logits on either side
    dedup = ForwardWork(dedup_w.tokens, dedup_w.attended_pairs, 0)
    ideal = {
        "infer": flops(shape, plain, "none").forward / flops(shape, dedup, "none").forward,
        "train": flops(shape, plain, "none").forward_backward / flops(shape, dedup, "none").forward_backward,
    }
    return {"actors": actors, "inputs": (seq, act, att), "ideal": ideal}


def trial(ctx: dict[str, Any], case: Case, args: argparse.Namespace) -> Trial:
    import torch

    seq, act, att = ctx["inputs"]

    def step(arm: str, phase: str):
        def run() -> float:
            critic = ctx["actors"][arm]
            critic.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if phase == "infer":
                critic.eval()
                with torch.no_grad():
                    critic(seq, act, att)
            else:
                critic.train()
                values, _ = critic(seq, action_mask=act, attention_mask=att, return_output=True)
                values.sum().backward()
            return time.perf_counter() - t0

        return run

    phase = case["phase"]
    return Trial(
        {arm: step(arm, phase) for arm in ARMS},
        clock=self_timed,
        ideal=ctx["ideal"][phase],
        notes={"zorro": ctx["actors"]["zorro"]},
    )


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    calls = t.notes["zorro"].zorro_calls
    if calls["fallback"]:  # the zorro arm would have timed OpenRLHF's own forward
        raise RuntimeError(f"zorro's critic fell back to OpenRLHF's forward: {calls}")
    return paired_rows(case["phase"], t, "openrlhf", "zorro")


BENCH = Benchmark(
    name="openrlhf_critic",
    doc=__doc__ or "",
    cases=cases,
    arms=ARMS,
    setup=setup,
    trial=trial,
    rows=rows,
    arguments=arguments,
    quick={"responses": 2, "prompt_len": 16, "response_len": 8, "rounds": 1},
    rounds=5,
    out="results/openrlhf_critic.csv",
    columns=PAIRED_COLUMNS,
    meta=meta,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
