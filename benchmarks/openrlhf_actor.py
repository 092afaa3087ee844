"""OpenRLHF's Actor.forward (+ backward) with and without zorro, on CPU, against the cost model's ideal speedup.

    .ci/openrlhf_tests --collect-only -q >/dev/null   # once: makes the OpenRLHF venv (.venv-openrlhf)
    DS_ACCELERATOR=cpu PYTHONPATH=. .venv-openrlhf/bin/python benchmarks/openrlhf_actor.py [--prompts 2
        --responses 4 --prompt-len 512 --response-len 64 --preset small-qwen3 --repeats 5
        --out results/openrlhf_actor.csv]

Both arms are built by OpenRLHF's constructor from the same checkpoint (float32, sdpa; `--packing on`:
OpenRLHF's `packing_samples`, one varlen row, whose sdpa mask on CPU is dense over the whole pack, quadratic
in it, which flatters zorro; `--packing off`: the padded path, OpenRLHF's faster one on CPU), the micro-batch by OpenRLHF's own Experience batching (prompt +
response per row, right-padded; siblings adjacent, as the rollout delivers them). Phases: "infer" is the
old/reference log-prob call (`PolicyModelActor.forward`: no grad), "train" the call of
`ActorPPOTrainer.training_step` (`return_output=True`; entropy off, OpenRLHF's default) plus the backward
of the summed log-probs. Runs alternate OpenRLHF / zorro after one warm-up round (zorro_harness.bench.arms,
the order reversed every round); the CSV keeps every
sample, the summary medians, p20-p80, and the speedup as the ratio of medians with the p20-p80 range of
the per-pair ratios.

Ideal (zorro_core.plan.cost): OpenRLHF's forward computes logits at every token (logits mode "none"),
zorro's only where a response token is predicted; training = 3 x forward. Responses have random lengths
in [response_len / 2, response_len].
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from zorro_harness.bench.arms import (  # noqa: E402
    PAIRED_COLUMNS,
    Benchmark,
    Case,
    Timings,
    Trial,
    main,
    paired_report,
    paired_rows,
)
from zorro_harness.bench.measure import self_timed  # noqa: E402

PHASES = ("infer", "train")
ARMS = ("openrlhf", "zorro")


def rollout(args: argparse.Namespace, vocab: int) -> list[tuple[Any, Any]]:
    """(prompt, response) token tensors from a generator seeded with `args.seed`: `args.prompts` random
    prompts of `args.prompt_len` tokens, each with `args.responses` responses of random lengths in
    [response_len / 2, response_len], siblings adjacent (as OpenRLHF's rollout delivers them)."""
    import torch

    g = torch.Generator().manual_seed(args.seed)
    pairs = []
    for _ in range(args.prompts):
        prompt = torch.randint(2, vocab, (args.prompt_len,), generator=g)
        for _ in range(args.responses):
            n = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            pairs.append((prompt, torch.randint(2, vocab, (n,), generator=g)))
    return pairs


def workloads(args: argparse.Namespace, pairs: list[tuple[Any, Any]]):
    """The cost model's (plain, deduplicated) workloads of a `rollout`."""
    from zorro_core.plan.cost import shape_workloads

    return shape_workloads(
        [args.prompt_len] * args.prompts,
        [args.responses] * args.prompts,
        [[len(r) for _, r in pairs[i * args.responses : (i + 1) * args.responses]] for i in range(args.prompts)],
    )


def arguments(ap: argparse.ArgumentParser, packing: str = "on") -> None:
    """The shape and threads options (the critic benchmark takes them too, with packing off by default)."""
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packing", choices=["on", "off"], default=packing, help="OpenRLHF's packing_samples")


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(phase, {"phase": phase}) for phase in PHASES]


def setup(args: argparse.Namespace, cases: list[Case]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)

    import openrlhf_setup  # the flash-attn stand-in on sys.path before OpenRLHF imports
    from openrlhf.models import Actor

    from zorro_core.integrations.openrlhf import DedupActor
    from zorro_core.models.presets import preset_config
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops

    path = openrlhf_setup.save_tiny(f"/tmp/zorro_openrlhf_bench_{args.preset}", preset=args.preset)
    config = preset_config(args.preset)
    pairs = rollout(args, config.vocab_size)
    seq, att, act = openrlhf_setup.right_padded(pairs)
    packed = args.packing == "on"
    actors = {
        "openrlhf": openrlhf_setup.make_actor(Actor, path, dtype=torch.float32, attn="sdpa", packing_samples=packed),
        "zorro": openrlhf_setup.make_actor(DedupActor, path, dtype=torch.float32, attn="sdpa", packing_samples=packed),
    }
    shape = model_shape(config)
    base_w, dedup_w = workloads(args, pairs)
    base_all = ForwardWork(base_w.tokens, base_w.attended_pairs, base_w.tokens)  # OpenRLHF: logits at every token
    ideal = {
        "infer": flops(shape, base_all, "none").forward / flops(shape, dedup_w, "compute").forward,
        "train": flops(shape, base_all, "none").forward_backward / flops(shape, dedup_w, "compute").forward_backward,
    }
    return {"actors": actors, "inputs": (seq, act, att), "ideal": ideal}


def trial(ctx: dict[str, Any], case: Case, args: argparse.Namespace) -> Trial:
    import torch

    seq, act, att = ctx["inputs"]

    def step(arm: str, phase: str):
        def run() -> float:
            actor = ctx["actors"][arm]
            actor.model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if phase == "infer":
                actor.eval()
                with torch.no_grad():
                    actor(seq, act, att)
            else:
                actor.train()
                lp, _ = actor(seq, act, attention_mask=att, return_output=True, return_entropy=False)
                lp.sum().backward()
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
        raise RuntimeError(f"zorro's actor fell back to OpenRLHF's forward: {calls}")
    return paired_rows(case["phase"], t, "openrlhf", "zorro")


def meta(args: argparse.Namespace) -> dict[str, Any]:
    import datetime
    from importlib.metadata import version

    import torch

    return {
        "openrlhf": version("openrlhf"),
        "deepspeed": version("deepspeed"),
        "torch": torch.__version__,
        "host": platform.node(),
        "threads": args.threads,
        "load": f"{os.getloadavg()[0]:.1f}",
        "preset": args.preset,
        "packing_samples": args.packing,
        "shape": f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}, {args.preset}, "
        f"packing {args.packing}, {args.threads} threads"
    )
    paired_report(rows, args)


BENCH = Benchmark(
    name="openrlhf_actor",
    doc=__doc__ or "",
    cases=cases,
    arms=ARMS,
    setup=setup,
    trial=trial,
    rows=rows,
    arguments=arguments,
    quick={"responses": 2, "prompt_len": 16, "response_len": 8, "rounds": 1},
    rounds=5,
    out="results/openrlhf_actor.csv",
    columns=PAIRED_COLUMNS,
    meta=meta,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
