"""Imbalance (max/mean cost) of Karmarkar-Karp against the greedy baseline on random workloads.

max/ideal: the largest part's cost over (unique tokens / parts), so a split's recomputed
prompts count against it too.

    PYTHONPATH=. python benchmarks/balance_imbalance.py [--n 300] [--seed 0]

Workloads are GRPO-like: G prompts of 64..2048 tokens, each sampled n in {2, 4, 8, 16} times,
responses of 16..1024 tokens. Micro-batches: budget = (largest group's tokens) x U(0.5, 3), so
some groups must be split. Ranks: 8/4/2 ranks, equal row counts, cost = tokens (attention
term 0); "whole" workloads have G divisible by the ranks, "cut" ones do not (groups cut).
"""

from __future__ import annotations

import argparse
import random
import statistics

from zorro_core.plan.balance import GroupedLengths, partition_micro_batches, partition_ranks


def workload(rng: random.Random, ranks: int | None = None, whole: bool = True) -> GroupedLengths:
    size = rng.choice([2, 4, 8, 16])
    g = rng.randint(2, 16)
    if ranks is not None:
        if not whole:  # G not divisible by the ranks, so n must be for equal row counts
            size = rng.choice([s for s in (2, 4, 8, 16) if s % ranks == 0])
        g = ranks * rng.randint(1, 4) if whole else ranks * rng.randint(1, 3) + rng.randint(1, ranks - 1)
    gor = [i for i in range(g) for _ in range(size)]
    return GroupedLengths(gor, [rng.randint(64, 2048) for _ in range(g)], [rng.randint(16, 1024) for _ in gor])


def figures(n: int = 300, seed: int = 0) -> dict[str, dict[str, list[float]]]:
    rng = random.Random(seed)
    out: dict[str, dict[str, list[float]]] = {}

    def add(scenario, balance, key, value):
        out.setdefault(f"{scenario} / {balance}", {}).setdefault(key, []).append(value)

    for _ in range(n):
        work = workload(rng)
        budget = int(max(work.tokens(r) for r in work.rows_of_group) * rng.uniform(0.5, 3.0))
        unique = sum(work.prompt_lens) + sum(work.response_lens)
        for balance in ("kk", "greedy"):
            p = partition_micro_batches(work, budget, balance=balance)
            add("micro-batches", balance, "imbalance", p.imbalance)
            add("micro-batches", balance, "micro-batches", len(p.parts))
            add("micro-batches", balance, "recomputed %", 100 * p.recomputed_prompt_tokens / unique)
            add("micro-batches", balance, "max/ideal", max(p.costs) * len(p.parts) / unique)
        for whole in (True, False):
            ranks = rng.choice([2, 4, 8])
            work = workload(rng, ranks, whole)
            unique = sum(work.prompt_lens) + sum(work.response_lens)
            for balance in ("kk", "greedy"):
                p = partition_ranks(work, ranks, balance=balance)
                scen = "ranks, groups " + ("whole" if whole else "cut")
                add(scen, balance, "imbalance", p.imbalance)
                add(scen, balance, "recomputed %", 100 * p.recomputed_prompt_tokens / unique)
                add(scen, balance, "max/ideal", max(p.costs) * ranks / unique)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    figs = figures(args.n, args.seed)
    print(f"{args.n} random workloads, seed {args.seed}")
    print(
        f"{'scenario / balancer':34s} {'imbalance mean':>14s} {'p90':>7s} {'worst':>7s} {'recomputed %':>13s} {'max/ideal':>10s} {'parts':>6s}"
    )
    for name, f in figs.items():
        imb = sorted(f["imbalance"])
        parts = f"{statistics.mean(f['micro-batches']):6.2f}" if "micro-batches" in f else "     -"
        print(
            f"{name:34s} {statistics.mean(imb):14.4f} {imb[int(0.9 * len(imb))]:7.4f} {imb[-1]:7.4f} "
            f"{statistics.mean(f['recomputed %']):13.2f} {statistics.mean(f['max/ideal']):10.4f} {parts}"
        )


if __name__ == "__main__":
    main()
