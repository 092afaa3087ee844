"""The self-check's one-off cost on the quick suite's first step, a benchmark.

    PYTHONPATH=. python benchmarks/self_check_cost.py [--rounds 5] [--out results/self_check_cost.csv]

The quick suite's shape (suites/quick.toml: small-qwen3, float32, B=8, R=32, sdpa split mode, one
torch thread) with P=128/384 and U=1/8 unique prompts. Each arm builds a new DeduplicatedActor and
runs its first step (forward + backward of the log-probs' sum): `off` with self_check=False, `on`
with self_check=True, for the CPU default backend (sdpa) and for flash_cpu (the GPU path's code);
arms interleaved by the harness's timer. Per case: the first step's median time off and on, the
added time (median of the rounds' paired differences) and its ratio; `check_s`, the check's own
time as it measures it (three forward+backward passes of the slice, float32); and the cost model's
ideal (zorro_core.plan.cost): the slice's three passes (dedup + two plain) over the step's, in
forward+backward FLOPs (an upper bound: the check's backward computes no weight gradients).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, Timings, Trial, main

BACKENDS = ("sdpa", "flash_cpu")


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 384])
    ap.add_argument("--unique", type=int, nargs="+", default=[1, 8], help="unique prompts of the 8 rows")


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


_CHECK_SECONDS: dict[str, list[float]] = {}


def _batch(model: Any, case: Case) -> Any:
    from zorro_core import create_dummy_batch

    return create_dummy_batch(
        batch_size=8,
        num_unique_prompts=case["unique"],
        prompt_len=case["prompt_len"],
        response_len=32,
        vocab_size=model.config.vocab_size,
    )


def trial(model: Any, case: Case, args: argparse.Namespace) -> Trial:
    from zorro_core import DeduplicatedActor

    batch = _batch(model, case)

    def first_step(backend: str, on: bool):
        def run() -> None:
            actor = DeduplicatedActor(model=model, varlen_backend=backend, self_check=on)
            actor.forward(batch).log_probs.sum().backward()
            if on:
                (verdict,) = actor.self_check.verdicts.values()
                assert verdict.passed, verdict.describe()
                _CHECK_SECONDS.setdefault(f"{case.id}/{backend}", []).append(verdict.seconds)

        return run

    arms = {f"{be}_{'on' if on else 'off'}": first_step(be, on) for be in BACKENDS for on in (False, True)}
    return Trial(arms, between=lambda: model.zero_grad(set_to_none=True))


def ideal(model: Any, case: Case) -> float:
    """The cost model's ratio: the check's three slice passes over the step's, forward+backward FLOPs."""
    from zorro_core.actor.self_check import slice_of
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.build import build_dedup_plan
    from zorro_core.plan.cost import flops, plan_workload

    shape = model_shape(model.config)
    batch = _batch(model, case)
    part = slice_of(batch)

    def fb(b: Any, dedup: bool) -> float:
        return flops(shape, plan_workload(build_dedup_plan(b, dedup=dedup))).forward_backward

    return (fb(part, True) + 2 * fb(part, False)) / fb(batch, True)


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("small-qwen3"))
    out = []
    for be in BACKENDS:
        off, on = t.seconds(f"{be}_off"), t.seconds(f"{be}_on")
        added = statistics.median(b - a for a, b in zip(off, on))
        out.append(
            {
                "case": case.id,
                "backend": be,
                "first_step_off_ms": round(t.median_ms(f"{be}_off"), 1),
                "first_step_on_ms": round(t.median_ms(f"{be}_on"), 1),
                "added_ms": round(1000 * added, 1),
                "added_over_step": round(added / statistics.median(off), 3),
                "check_s": round(statistics.median(_CHECK_SECONDS.get(f"{case.id}/{be}", [float("nan")])), 3),
                "ideal_over_step": round(ideal(model, case), 3),
            }
        )
    return out


BENCH = Benchmark(
    name="self_check_cost",
    doc=__doc__ or "",
    cases=cases,
    arms=tuple(f"{be}_{s}" for be in BACKENDS for s in ("off", "on")),
    setup=setup,
    trial=trial,
    rows=rows,
    arguments=arguments,
    quick={"prompt_lens": [32], "unique": [1], "rounds": 1, "warmup": 0},
    warmup=1,
    rounds=5,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
