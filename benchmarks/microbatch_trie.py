"""Micro-batches of a sharing="prefix" batch: cut along the trie vs by prompt group (CPU, one thread).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/microbatch_trie.py [--repeats 7] [--preset small-qwen3]
        [--out microbatch_trie.csv]

8 groups x 4 responses: a 512-token system prompt shared by every group, a 64-token user turn per
group, 64-token responses; budget = two groups' tokens by prompt (2 x (576 + 4 x 64) = 1,664).
Both arms run the same prefix-sharing actor and the same accumulation loop; only the partition
differs: "trie" is what `forward_backward` runs now (zorro_core.plan.trie_balance), "prompt" the
prompt-group partition it ran before (zorro_core.plan.balance.partition_micro_batches). Prints
each arm's micro-batches, computed tokens, the cost model's forward+backward FLOPs (and the ideal
speedup they imply), and the forward+backward time: runs interleaved (zorro_harness.bench.arms, one
warm-up round), median and min-max, and the ratio of each round's two runs, median with p20-p80
(robust to load that drifts between rounds).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, Timings, Trial, main

ARMS = ("trie", "prompt")


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4, help="responses per group")
    ap.add_argument("--system-len", type=int, default=512, help="the system prompt every group shares")
    ap.add_argument("--user-len", type=int, default=64, help="each group's own user turn")
    ap.add_argument("--response-len", type=int, default=64)


def cases(args: argparse.Namespace) -> list[Case]:
    name = f"{args.preset}:g{args.groups}x{args.group_size}s{args.system_len}u{args.user_len}r{args.response_len}"
    return [Case(name, {"case": name})]


def accumulate(actor, batch, parts, weights, n):
    """One forward+backward per micro-batch, gradients accumulated (forward_backward's loop)."""
    import torch

    from zorro_core.plan.balance import select_rows

    plans = []
    for rows in parts:
        idx = torch.tensor(rows)
        out = actor.forward(select_rows(batch, idx))
        ((weights[idx] * out.log_probs).sum() / n).backward()
        plans.append(out.plan)
    return plans


def trial(context: None, case: Case, args: argparse.Namespace) -> Trial:
    import torch

    from zorro_core import DeduplicatedActor, create_dummy_batch
    from zorro_core.actor.microbatch import micro_batch_partition
    from zorro_core.models.presets import load_model
    from zorro_core.plan.balance import GroupedLengths, partition_micro_batches
    from zorro_core.plan.trie_balance import TrieLengths, partition_trie_micro_batches

    torch.set_num_threads(1)
    groups, size, system, user, resp = args.groups, args.group_size, args.system_len, args.user_len, args.response_len
    model = load_model(args.preset, dtype=torch.float32)
    batch = create_dummy_batch(
        batch_size=groups * size,
        num_unique_prompts=groups,
        prompt_len=system + user,
        response_len=resp,
        vocab_size=model.config.vocab_size,
        shared_prefix_len=system,
        seed=0,
    )
    budget = 2 * (system + user + size * resp)
    actor = DeduplicatedActor(model=model, sharing="prefix")
    partitions = {
        "trie": partition_trie_micro_batches(TrieLengths.of(batch, actor.config.min_shared_tokens), budget).parts,
        "prompt": partition_micro_batches(GroupedLengths.of(batch), budget).parts,
    }
    assert partitions["trie"] == micro_batch_partition(actor, batch, budget, 0.0).parts  # what forward_backward runs
    weights = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(0))
    n = batch.response_mask.sum()
    notes: dict[str, Any] = {"model": model, "budget": budget, "whole_tokens": actor.plan(batch).num_tokens}

    def arm(name: str):
        def run() -> None:
            notes[name] = accumulate(actor, batch, partitions[name], weights, n)

        return run

    return Trial({name: arm(name) for name in ARMS}, between=lambda: model.zero_grad(set_to_none=True), notes=notes)


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import flops, plan_workload

    shape = model_shape(t.notes["model"].config)
    fb = {a: sum(flops(shape, plan_workload(p)).forward_backward for p in t.notes[a]) for a in ARMS}
    tokens = {a: sum(p.num_tokens for p in t.notes[a]) for a in ARMS}
    sp = t.speedup("prompt", "trie")  # each round's two runs, back to back: robust to load that drifts
    out = []
    for a in ARMS:
        s = t.stats(a)
        out.append(
            {
                **case.fields,
                "arm": a,
                "budget": t.notes["budget"],
                "micro_batches": len(t.notes[a]),
                "tokens": tokens[a],
                "whole_batch_tokens": t.notes["whole_tokens"],
                "gflop_fwd_bwd": round(fb[a] / 1e9, 3),
                "median_s": round(s.p50 / 1e3, 4),
                "min_s": round(min(s.samples) / 1e3, 4),
                "max_s": round(max(s.samples) / 1e3, 4),
                "n": s.n,
                "speedup_vs_prompt": round(sp.value, 3) if a == "trie" else 1.0,
                "speedup_p20": round(sp.p20, 3) if a == "trie" else "",
                "speedup_p80": round(sp.p80, 3) if a == "trie" else "",
                "ideal": round(fb["prompt"] / fb[a], 3),
            }
        )
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    if not rows:
        return
    r0 = rows[0]
    print(
        f"{args.preset} float32, 1 thread, {args.groups} groups x {args.group_size}, system {args.system_len}, "
        f"user {args.user_len}, responses {args.response_len}, budget {r0['budget']} tokens; "
        f"one pass over the whole batch: {r0['whole_batch_tokens']:,} tokens"
    )
    for r in rows:
        print(
            f"{r['arm']:7s} {r['micro_batches']} micro-batches  {r['tokens']:6,} tokens  {r['gflop_fwd_bwd']:7.2f} GFLOP "
            f"fwd+bwd  {r['median_s']:6.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f}, n={r['n']})"
        )
    by = {r["arm"]: r for r in rows}
    if {"trie", "prompt"} <= set(by):
        t, p = by["trie"], by["prompt"]
        print(
            f"trie vs prompt: tokens {p['tokens'] / t['tokens']:.3f}x, ideal (cost model, fwd+bwd FLOPs) {t['ideal']:.3f}x, "
            f"measured: medians {p['median_s'] / t['median_s']:.3f}x, per round median {t['speedup_vs_prompt']:.3f}x "
            f"(p20 {t['speedup_p20']:.3f}, p80 {t['speedup_p80']:.3f})"
        )


BENCH = Benchmark(
    name="microbatch_trie",
    doc=__doc__ or "",
    cases=cases,
    arms=ARMS,
    trial=trial,
    rows=rows,
    arguments=arguments,
    quick={"groups": 4, "group_size": 2, "system_len": 48, "user_len": 8, "response_len": 8, "rounds": 1},
    warmup=1,
    rounds=7,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
