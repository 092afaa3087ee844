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
of the summed log-probs. Runs alternate OpenRLHF / zorro after one warm-up of each; the CSV keeps every
sample, the summary medians, p20-p80, and the speedup as the ratio of medians with the p20-p80 range of
the per-pair ratios.

Ideal (zorro_core.plan.cost): OpenRLHF's forward computes logits at every token (logits mode "none"),
zorro's only where a response token is predicted; training = 3 x forward. Responses have random lengths
in [response_len / 2, response_len].
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from verl_engine import quantile  # noqa: E402  (stdlib and torch only at import)

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--responses", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packing", choices=["on", "off"], default="on", help="OpenRLHF's packing_samples")
    ap.add_argument("--out", default="results/openrlhf_actor.csv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import openrlhf_setup  # the flash-attn stand-in on sys.path before OpenRLHF imports
    from openrlhf.models import Actor

    from zorro_core.integrations.openrlhf import DedupActor
    from zorro_core.models.presets import preset_config
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops, shape_workloads

    path = openrlhf_setup.save_tiny(f"/tmp/zorro_openrlhf_bench_{args.preset}", preset=args.preset)
    config = preset_config(args.preset)
    g = torch.Generator().manual_seed(args.seed)
    pairs = []
    for _ in range(args.prompts):
        prompt = torch.randint(2, config.vocab_size, (args.prompt_len,), generator=g)
        for _ in range(args.responses):
            n = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            pairs.append((prompt, torch.randint(2, config.vocab_size, (n,), generator=g)))
    seq, att, act = openrlhf_setup.right_padded(pairs)
    packed = args.packing == "on"
    actors = {
        "openrlhf": openrlhf_setup.make_actor(Actor, path, dtype=torch.float32, attn="sdpa", packing_samples=packed),
        "zorro": openrlhf_setup.make_actor(DedupActor, path, dtype=torch.float32, attn="sdpa", packing_samples=packed),
    }

    def step(arm: str, phase: str) -> float:
        actor = actors[arm]
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

    shape = model_shape(config)
    base_w, dedup_w = shape_workloads(
        [args.prompt_len] * args.prompts,
        [args.responses] * args.prompts,
        [[len(r) for _, r in pairs[i * args.responses : (i + 1) * args.responses]] for i in range(args.prompts)],
    )
    base_all = ForwardWork(base_w.tokens, base_w.attended_pairs, base_w.tokens)  # OpenRLHF: logits at every token
    ideal = {
        "infer": flops(shape, base_all, "none").forward / flops(shape, dedup_w, "compute").forward,
        "train": flops(shape, base_all, "none").forward_backward / flops(shape, dedup_w, "compute").forward_backward,
    }

    samples: dict[tuple[str, str], list[float]] = {}
    for phase in ("infer", "train"):
        for arm in actors:
            step(arm, phase)  # warm-up
        for _ in range(args.repeats):
            for arm in actors:
                samples.setdefault((phase, arm), []).append(step(arm, phase))
                print(phase, arm, f"{samples[(phase, arm)][-1]:.3f} s", flush=True)
    assert actors["zorro"].zorro_calls["fallback"] == 0, actors["zorro"].zorro_calls

    from importlib.metadata import version

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    meta = {
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
    with open(args.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kind", "phase", "arm", "value", "p20", "p80", "n", *meta])
        print(
            f"openrlhf {meta['openrlhf']}, {meta['shape']}, {args.preset}, packing {args.packing}, {args.threads} threads"
        )
        for phase in ("infer", "train"):
            b, z = samples[(phase, "openrlhf")], samples[(phase, "zorro")]
            for i, (tb, tz) in enumerate(zip(b, z)):
                w.writerow(["sample", phase, "openrlhf", f"{tb:.4f}", "", "", i, *meta.values()])
                w.writerow(["sample", phase, "zorro", f"{tz:.4f}", "", "", i, *meta.values()])
            for arm, xs in (("openrlhf", b), ("zorro", z)):
                row = [f"{statistics.median(xs):.4f}", f"{quantile(xs, 0.2):.4f}", f"{quantile(xs, 0.8):.4f}"]
                w.writerow(["median_s", phase, arm, *row, len(xs), *meta.values()])
            ratios = [tb / tz for tb, tz in zip(b, z)]
            speedup = statistics.median(b) / statistics.median(z)
            eff = speedup / ideal[phase]
            spread = [f"{quantile(ratios, 0.2):.3f}", f"{quantile(ratios, 0.8):.3f}"]
            w.writerow(["speedup", phase, "zorro/openrlhf", f"{speedup:.3f}", *spread, len(ratios), *meta.values()])
            w.writerow(["ideal", phase, "cost model", f"{ideal[phase]:.3f}", "", "", "", *meta.values()])
            w.writerow(["efficiency", phase, "speedup/ideal", f"{eff:.3f}", "", "", "", *meta.values()])
            print(
                f"{phase}: openrlhf {statistics.median(b):.3f} s [{quantile(b, 0.2):.3f}, {quantile(b, 0.8):.3f}], "
                f"zorro {statistics.median(z):.3f} s [{quantile(z, 0.2):.3f}, {quantile(z, 0.8):.3f}]; "
                f"speedup {speedup:.2f}x (pairs p20-p80 {spread[0]}-{spread[1]}), "
                f"ideal {ideal[phase]:.2f}x, efficiency {eff:.2f}"
            )


if __name__ == "__main__":
    main()
