"""Imbalance (max/mean cost) of Karmarkar-Karp against the greedy baseline on random workloads.

max/ideal: the largest part's cost over (unique tokens / parts), so a split's recomputed
prompts count against it too.

    PYTHONPATH=. python benchmarks/balance_imbalance.py [--n 300] [--seed 0] [--out imbalance.csv]

Workloads are GRPO-like: G prompts of 64..2048 tokens, each sampled n in {2, 4, 8, 16} times,
responses of 16..1024 tokens. Micro-batches: budget = (largest group's tokens) x U(0.5, 3), so
some groups must be split. Ranks: 8/4/2 ranks, equal row counts, cost = tokens (attention
term 0); "whole" workloads have G divisible by the ranks, "cut" ones do not (groups cut).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

from zorro_core.plan.balance import GroupedLengths, partition_micro_batches, partition_ranks
from zorro_harness.bench.arms import Benchmark, Case, main


def _positive(text: str) -> int:
    """An argparse type: a whole number >= 1 (0 workloads would report "ok" with no rows)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


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


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n", type=_positive, default=300, help="random workloads (>= 1)")
    ap.add_argument("--seed", type=int, default=0)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case("random_workloads", {"workloads": args.n, "seed": args.seed})]


def compute(context: None, case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for name, f in figures(case["workloads"], case["seed"]).items():
        imb = sorted(f["imbalance"])
        scenario, balance = name.split(" / ")
        out.append(
            {
                **case.fields,
                "scenario": scenario,
                "balance": balance,
                "imbalance_mean": round(statistics.mean(imb), 4),
                "imbalance_p90": round(imb[int(0.9 * len(imb))], 4),
                "imbalance_worst": round(imb[-1], 4),
                "recomputed_pct": round(statistics.mean(f["recomputed %"]), 2),
                "max_over_ideal": round(statistics.mean(f["max/ideal"]), 4),
                "parts": round(statistics.mean(f["micro-batches"]), 2) if "micro-batches" in f else "",
            }
        )
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"{args.n} random workloads, seed {args.seed}")
    print(
        f"{'scenario / balancer':34s} {'imbalance mean':>14s} {'p90':>7s} {'worst':>7s} {'recomputed %':>13s} {'max/ideal':>10s} {'parts':>6s}"
    )
    for r in rows:
        parts = f"{r['parts']:6.2f}" if r["parts"] != "" else "     -"
        print(
            f"{r['scenario'] + ' / ' + r['balance']:34s} {r['imbalance_mean']:14.4f} {r['imbalance_p90']:7.4f} "
            f"{r['imbalance_worst']:7.4f} {r['recomputed_pct']:13.2f} {r['max_over_ideal']:10.4f} {parts}"
        )


BENCH = Benchmark(
    name="balance_imbalance",
    doc=__doc__ or "",
    cases=cases,
    arms=("kk", "greedy"),
    compute=compute,
    arguments=arguments,
    quick={"n": 5},
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
