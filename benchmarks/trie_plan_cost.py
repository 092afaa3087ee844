"""Host cost of the prefix-tree plan against the prompt plan at B=1024, P+R=32K (one thread).

    PYTHONPATH=. python benchmarks/trie_plan_cost.py [--out plan_cost.csv]

1024 rows: 64 distinct prompts of 28,672 tokens that share a 4,096-token prefix, each row with
its own 4,096-token response. Prints each plan's time (the two arms alternated, twice) and the
trie's parts (validation, rows to the host, sort + LCP + nodes), each timed once.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, Timings, Trial, main
from zorro_harness.bench.measure import time_once

SHARING = ("prompt", "prefix")


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=28672)
    ap.add_argument("--response-len", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts")
    ap.add_argument("--prefix-len", type=int, default=4096, help="the prefix every prompt shares")


def cases(args: argparse.Namespace) -> list[Case]:
    name = f"b{args.rows}p{args.prompt_len}r{args.response_len}g{args.prompts}h{args.prefix_len}"
    return [Case(name, {"case": name})]


def batch_of(args: argparse.Namespace) -> Any:
    import torch

    from zorro_core import RolloutBatch

    b, p, r, g_count, head = args.rows, args.prompt_len, args.response_len, args.prompts, args.prefix_len
    g = torch.Generator().manual_seed(0)
    system = torch.randint(1, 150000, (head,), generator=g)
    questions = torch.randint(1, 150000, (g_count, p - head), generator=g)
    prompts = torch.cat([system.expand(b, -1), questions[torch.arange(b) % g_count]], 1)
    responses = torch.randint(1, 150000, (b, r), generator=g)
    return RolloutBatch(prompts, torch.ones_like(prompts), responses, torch.ones_like(responses))


def trial(context: None, case: Case, args: argparse.Namespace) -> Trial:
    import torch

    from zorro_core import build_dedup_plan

    torch.set_num_threads(1)
    batch = batch_of(args)
    notes: dict[str, Any] = {"batch": batch}

    def plan(sharing: str):
        def run() -> None:
            notes[f"{sharing}_tokens"] = build_dedup_plan(batch, sharing=sharing).num_tokens

        return run

    return Trial({s: plan(s) for s in SHARING}, notes=notes)


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    from zorro_core.plan import trie

    batch = t.notes["batch"]
    out = []
    for sharing in SHARING:
        for i, ms in enumerate(t.samples[sharing]):
            out.append({**case.fields, "step": f"{sharing} plan", "round": i, "seconds": round(ms / 1e3, 3),
                        "packed_tokens": t.notes[f"{sharing}_tokens"]})  # fmt: skip
    host: list[Any] = []
    parts = {
        "of which validation": batch.validate,
        "trie: rows to the host": lambda: host.extend(trie._rows_on_host(batch)[:2]),
        "trie: sort + LCP + nodes": lambda: trie._radix_tree(*host),
    }
    for step, fn in parts.items():  # in this order: the last one needs the host rows
        out.append({**case.fields, "step": step, "round": 0, "seconds": round(time_once(fn, "cpu") / 1e3, 3)})
    return out


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    for r in rows:
        if r["step"].endswith(" plan"):
            print(f"{r['step'][:-5]:7s} plan {r['seconds']:6.2f} s  packed tokens {r['packed_tokens']:,}")
        else:
            print(f"  {r['step']:26s} {r['seconds']:6.2f} s")


BENCH = Benchmark(
    name="trie_plan_cost",
    doc=__doc__ or "",
    cases=cases,
    arms=SHARING,
    trial=trial,
    rows=rows,
    arguments=arguments,
    quick={"rows": 16, "prompt_len": 96, "response_len": 16, "prompts": 4, "prefix_len": 32},
    warmup=0,
    rounds=2,
    columns=("case", "step", "round", "seconds", "packed_tokens"),
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
