"""The prompt-once schedule against within-micro-batch dedup and the packed baseline (CPU, one thread).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/schedule_step.py [--repeats 5] [--preset small-qwen3]
        [--groups 2] [--group-size 8] [--prompt-len 512] [--response-len 64] [--out schedule_step.csv]

G groups x n responses, each group longer than the budget: budget = P + 3 R tokens, so under the
micro-batch schedule each group spans ceil(n / 3) micro-batches (n = 8: 3), each computing the
prompt again. Arms (one step each: forward + backward of every row, gradients accumulated):
- baseline:    BaselineActor.forward_backward (every row's prompt, packed, no padding);
- micro_batch: DeduplicatedActor.forward_backward (a prompt once per micro-batch holding its rows);
- prompt_once: forward_backward(schedule="prompt_once"): each prompt once per step, responses cut
               at 3 R response tokens (the same 3 responses per micro-batch: the conservative
               comparison), against the kept keys and values.
Prints each arm's micro-batches, computed tokens, the cost model's forward+backward FLOPs and the
ideal speedup they imply (prompt_once's ideal: each prompt once per step, the whole batch's dedup
plan), and the measured step time: runs interleaved (zorro_harness.bench.arms, one warm-up
round), median and min-max, and each round's ratio to the baseline arm, median with p20-p80.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, Timings, Trial, main

ARMS = ("baseline", "micro_batch", "prompt_once")


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8, help="responses per group")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--response-len", type=int, default=64)


def cases(args: argparse.Namespace) -> list[Case]:
    name = f"{args.preset}:g{args.groups}x{args.group_size}p{args.prompt_len}r{args.response_len}"
    return [Case(name, {"case": name})]


def trial(context: None, case: Case, args: argparse.Namespace) -> Trial:
    import torch

    from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
    from zorro_core.actor.microbatch import micro_batch_partition
    from zorro_core.models.presets import load_model

    torch.set_num_threads(1)
    g, n, p, r = args.groups, args.group_size, args.prompt_len, args.response_len
    model = load_model(args.preset, dtype=torch.float32)
    batch = create_dummy_batch(
        batch_size=g * n, num_unique_prompts=g, prompt_len=p, response_len=r, vocab_size=model.config.vocab_size, seed=0
    )
    budget = p + 3 * r
    actors = {"baseline": BaselineActor(model=model), "micro_batch": DeduplicatedActor(model=model)}
    actors["prompt_once"] = actors["micro_batch"]
    weights = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(0))
    count = batch.response_mask.sum()

    def loss_fn(out, rows):
        return (weights[rows] * out.log_probs).sum() / count

    notes: dict[str, Any] = {"model": model, "budget": budget, "batch": batch, "actors": actors}
    for a in ("baseline", "micro_batch"):
        notes[f"{a}_parts"] = micro_batch_partition(actors[a], batch, budget).parts

    def arm(name: str):
        schedule = "prompt_once" if name == "prompt_once" else "micro_batch"

        def run() -> None:
            # prompt_once: the same responses per micro-batch (3), its budget counting response tokens only.
            tokens = 3 * r if name == "prompt_once" else budget
            notes[name] = actors[name].forward_backward(batch, loss_fn, tokens, schedule=schedule)

        return run

    return Trial({a: arm(a) for a in ARMS}, between=lambda: model.zero_grad(set_to_none=True), notes=notes)


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.balance import select_rows
    from zorro_core.plan.cost import flops, plan_workload

    shape = model_shape(t.notes["model"].config)
    batch, actors = t.notes["batch"], t.notes["actors"]

    def fb_of(actor, parts):
        plans = [actor.plan(select_rows(batch, rows)) for rows in parts]
        return sum(flops(shape, plan_workload(pl)).forward_backward for pl in plans), sum(pl.num_tokens for pl in plans)

    fb, tokens, mbs = {}, {}, {}
    for a in ("baseline", "micro_batch"):
        fb[a], tokens[a] = fb_of(actors[a], t.notes[f"{a}_parts"])
        mbs[a] = len(t.notes[f"{a}_parts"])
    # Each prompt once per step: the whole batch's dedup plan (phase 1 + every response micro-batch).
    fb["prompt_once"], tokens["prompt_once"] = fb_of(actors["prompt_once"], [list(range(batch.batch_size))])
    res = t.notes["prompt_once"]
    assert tokens["prompt_once"] == res.prompt_tokens + sum(res.response_tokens)  # the schedule computed the ideal
    mbs["prompt_once"] = len(res.parts)
    out = []
    for a in ARMS:
        s = t.stats(a)
        sp = t.speedup("baseline", a)
        sm = t.speedup("micro_batch", a)
        out.append(
            {
                **case.fields,
                "arm": a,
                "budget": t.notes["budget"],
                "micro_batches": mbs[a],
                "tokens": tokens[a],
                "gflop_fwd_bwd": round(fb[a] / 1e9, 3),
                "median_s": round(s.p50 / 1e3, 4),
                "min_s": round(min(s.samples) / 1e3, 4),
                "max_s": round(max(s.samples) / 1e3, 4),
                "n": s.n,
                "speedup_vs_baseline": round(sp.value, 3),
                "speedup_vs_baseline_p20": round(sp.p20, 3),
                "speedup_vs_baseline_p80": round(sp.p80, 3),
                "ideal_vs_baseline": round(fb["baseline"] / fb[a], 3),
                "speedup_vs_micro_batch": round(sm.value, 3),
                "speedup_vs_micro_batch_p20": round(sm.p20, 3),
                "speedup_vs_micro_batch_p80": round(sm.p80, 3),
                "ideal_vs_micro_batch": round(fb["micro_batch"] / fb[a], 3),
                "kept_bytes": res.kept_bytes if a == "prompt_once" else 0,
            }
        )
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    if not rows:
        return
    print(
        f"{args.preset} float32, 1 thread, {args.groups} groups x {args.group_size}, prompts {args.prompt_len}, "
        f"responses {args.response_len}, budget {rows[0]['budget']} tokens"
    )
    for r in rows:
        print(
            f"{r['arm']:12s} {r['micro_batches']:2d} micro-batches {r['tokens']:7,} tokens {r['gflop_fwd_bwd']:8.2f} GFLOP "
            f"{r['median_s']:7.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f}, n={r['n']})  "
            f"vs baseline {r['speedup_vs_baseline']:.2f}x [p20 {r['speedup_vs_baseline_p20']:.2f}, "
            f"p80 {r['speedup_vs_baseline_p80']:.2f}] ideal {r['ideal_vs_baseline']:.2f}x  "
            f"vs micro_batch {r['speedup_vs_micro_batch']:.2f}x [p20 {r['speedup_vs_micro_batch_p20']:.2f}, "
            f"p80 {r['speedup_vs_micro_batch_p80']:.2f}] ideal {r['ideal_vs_micro_batch']:.2f}x"
        )


BENCH = Benchmark(
    name="schedule_step",
    doc=__doc__ or "",
    cases=cases,
    arms=ARMS,
    trial=trial,
    rows=rows,
    arguments=arguments,
    quick={"groups": 2, "group_size": 4, "prompt_len": 32, "response_len": 4, "rounds": 1},
    warmup=1,
    rounds=5,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
