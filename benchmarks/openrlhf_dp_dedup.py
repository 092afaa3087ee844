"""Per-call prompt dedup on each DP rank of OpenRLHF 0.11: its own batching beside zorro's, 2-32 ranks.

    DS_ACCELERATOR=cpu PYTHONPATH=. .venv-openrlhf/bin/python benchmarks/openrlhf_dp_dedup.py [--ranks 2 4 8 32
        --prompts-per-rank 8 --n 8 --seed 0 --out results/openrlhf_dp_dedup.csv]

No model runs: rows are (prompt length, response length) pairs, n siblings per prompt in rollout order,
`--prompts-per-rank` prompts per rank (the rollout grows with the ranks, as `rollout.batch_size` does).
`balance=openrlhf`: the partitions of OpenRLHF's own functions, in the order its trainer applies them:
- log-prob calls (old / reference, `PolicyModelActor.forward`): `split_rollout_samples` (fixed: contiguous
  chunks of `rollout.micro_batch_size`; dynamic: `get_seqlen_balanced_partitions` over total lengths into
  a multiple of the ranks, as many as `get_minimum_num_micro_batch_size` needs under
  `rollout.max_tokens_per_gpu`), then `RayActorGroup.async_run_method_batch` (contiguous chunks per rank).
- training calls (`ActorPPOTrainer.ppo_train`): fixed: the rank's share of the rollout, its replay buffer
  read by a shuffled DataLoader in `train.micro_batch_size` rows (drop_last); dynamic: `balance_experiences`
  across ranks, then each rank's `setup_dynamic_batch` (steps of `train.batch_size / dp` rows, the number of
  micro-batches of each step the maximum over the ranks, `get_seqlen_balanced_partitions`).
`balance=zorro`: zorro's functions that `install()` puts in their place
(`zorro_core.integrations.openrlhf.batching`): `rollout_micro_batches` for the log-prob calls,
`rank_rows` (`balance_experiences`) and the `GroupedReplayBuffer`'s partitions for training
(`fixed_micro_batches`; dynamic: per step the micro-batches zorro needs under the budget, the maximum
over the ranks, `budget_micro_batches`).
Figures per (ranks, batching, call, balance): the mean / min prompt dedup of the calls
(1 - distinct prompt tokens / prompt tokens of the call's rows), the rollout's dedup (each prompt once,
what sharing can reach) and the ratio of the two; each rank's cost (zorro's cost model: every call's
prompts once plus its responses, summed over the rank's calls) as max/mean and max - min, beside the
largest group's cost (zorro's spread may exceed OpenRLHF's by at most that); groups split.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace as ns
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from zorro_harness.bench.arms import Benchmark, Case, main  # noqa: E402


def dedup(rows, plen):
    prompts = [r[0] for r in rows]
    total = sum(plen[p] for p in prompts)
    return 1.0 - sum(plen[p] for p in set(prompts)) / total if total else 0.0


def call_cost(rows, plen):
    """zorro's cost model of one call (linear tokens: each distinct prompt once plus every response)."""
    return sum(plen[p] for p in {r[0] for r in rows}) + sum(r[1] for r in rows)


def config(w, rows, a):
    return ns(
        actor=ns(num_nodes=1, num_gpus_per_node=w),
        ds=ns(ring_attn_size=1, tensor_parallel_size=1),
        train=ns(dynamic_batch_enable=False, batch_size=rows // a.steps, max_tokens_per_gpu=a.max_tokens),
        rollout=ns(micro_batch_size=a.rollout_micro, max_tokens_per_gpu=a.max_tokens),
    )


def openrlhf_calls(rows, plen, w, a, seed):
    """{(batching, call): [[rows of each call] per rank]} from OpenRLHF's own functions."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience, balance_experiences
    from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size, get_seqlen_balanced_partitions

    total = [plen[p] + r for p, r in rows]
    out = {}

    def to_ranks(micro):
        size = -(-len(micro) // w)
        return [micro[i * size : (i + 1) * size] for i in range(w)]

    fixed = [list(range(i, min(i + a.rollout_micro, len(rows)))) for i in range(0, len(rows), a.rollout_micro)]
    need = get_minimum_num_micro_batch_size(total, a.max_tokens, 1, 1) // w * w
    dyn = get_seqlen_balanced_partitions(total, max(need, w), False)
    out["fixed", "logprob"] = to_ranks(fixed)
    out["dynamic", "logprob"] = to_ranks(dyn)
    g = torch.Generator().manual_seed(seed)
    train = []
    for calls in to_ranks(fixed):
        mine = [i for c in calls for i in c]
        order = [mine[j] for j in torch.randperm(len(mine), generator=g).tolist()]
        train.append([order[s : s + a.train_micro] for s in range(0, len(order) - a.train_micro + 1, a.train_micro)])
    out["fixed", "train"] = train
    exps = [
        Experience(
            sequences=torch.zeros((len(c), 1), dtype=torch.long),
            total_length=torch.tensor([total[i] for i in c]),
            info={"row": torch.tensor(list(c))},
        )
        for c in dyn
    ]
    cfg = config(w, len(rows), a)
    per_rank = [[int(x) for x in e.info["row"]] for e in balance_experiences(exps, cfg)]
    out["dynamic", "train"] = dynamic_steps(per_rank, total, cfg, None)
    return out


def dynamic_steps(per_rank, total, cfg, zorro_partition, zorro_need=None):
    """`setup_dynamic_batch` on each rank: steps of train.batch_size / dp rows, each step's micro-batch
    count the maximum over ranks (its all-reduce; zorro's: of what zorro needs), then OpenRLHF's
    partition or zorro's."""
    from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size, get_seqlen_balanced_partitions

    w = len(per_rank)
    local = cfg.train.batch_size // w
    steps = min(len(r) for r in per_rank) // local
    need = zorro_need or (
        lambda ids: get_minimum_num_micro_batch_size([total[i] for i in ids], cfg.train.max_tokens_per_gpu, 1, 1)
    )
    counts = [max(need(r[s * local : (s + 1) * local]) for r in per_rank) for s in range(steps)]
    out = []
    for r in per_rank:
        calls = []
        for s, k in enumerate(counts):
            ids = r[s * local : (s + 1) * local]
            if zorro_partition is None:
                parts = get_seqlen_balanced_partitions([total[i] for i in ids], k, equal_size=False)
                calls += [[ids[j] for j in p] for p in parts]
            else:
                calls += zorro_partition(ids, k)
        out.append(calls)
    return out


def zorro_calls(rows, plen, w, a, seed):
    """The same calls from zorro's batching (what install() registers)."""
    import torch

    from zorro_core.integrations import openrlhf_batching as zb
    from zorro_core.plan.balance import GroupedLengths, partition_micro_batches

    prompts = sorted({p for p, _ in rows})
    gid = {p: i for i, p in enumerate(prompts)}
    work = GroupedLengths([gid[p] for p, _ in rows], [plen[p] for p in prompts], [r for _, r in rows])
    total = [plen[p] + r for p, r in rows]
    out = {}
    for batching in ("fixed", "dynamic"):
        cfg = config(w, len(rows), a)
        cfg.train.dynamic_batch_enable = batching == "dynamic"
        micro = zb.rollout_micro_batches(work, cfg)
        per = len(micro) // w
        out[batching, "logprob"] = [micro[i * per : (i + 1) * per] for i in range(w)]
    cfg = config(w, len(rows), a)
    ranks = [[i for c in calls for i in c] for calls in out["fixed", "logprob"]]  # fixed: the log-prob shares
    g = torch.Generator().manual_seed(seed)
    train = []
    for mine in ranks:
        sub = zb._sub(work, mine)
        plan = zb.fixed_micro_batches(sub, a.train_micro, torch.randperm(len(sub.prompt_lens), generator=g).tolist())
        train.append([[mine[j] for j in m] for m in plan])
    out["fixed", "train"] = train
    per_rank = zb.rank_rows(work, cfg)

    def part(ids, k):
        return zb.budget_micro_batches(work, ids, cfg.train.max_tokens_per_gpu, k)

    def need(ids):  # GroupedReplayBuffer.setup_dynamic_batch: what zorro needs under the budget
        return len(partition_micro_batches(zb._sub(work, ids), cfg.train.max_tokens_per_gpu, zb.ATTENTION_WEIGHT).parts)

    out["dynamic", "train"] = dynamic_steps(per_rank, total, cfg, part, need)
    return out


HEADER = (
    "ranks", "prompts", "n", "batching", "call", "balance", "calls", "mean_dedup", "min_dedup",
    "rollout_dedup", "dedup_ratio", "rank_cost_max_over_mean", "rank_cost_spread", "max_group_cost",
    "split_groups", "plan_seconds",
)  # fmt: skip


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 32])
    ap.add_argument("--prompts-per-rank", type=int, default=8)
    ap.add_argument("--n", type=int, nargs="+", default=[8, 6], help="samples per prompt (6: sizes that do not divide)")
    ap.add_argument("--rollout-micro", type=int, default=16, help="rollout.micro_batch_size")
    ap.add_argument("--train-micro", type=int, default=8, help="train.micro_batch_size")
    ap.add_argument(
        "--steps", type=int, default=2, help="optimizer steps per rollout (train.batch_size = rows / steps)"
    )
    ap.add_argument("--max-tokens", type=int, default=8192, help="rollout/train.max_tokens_per_gpu")
    ap.add_argument("--seed", type=int, default=0)


def cases(a: argparse.Namespace) -> list[Case]:
    return [Case(f"n{n}:ranks{w}", {"ranks": w, "n": n}) for n in a.n for w in a.ranks]


def compute(context: None, case: Case, a: argparse.Namespace) -> list[dict[str, Any]]:
    import openrlhf_setup  # noqa: F401  (the flash-attn stand-in before OpenRLHF imports)

    n, w = case["n"], case["ranks"]
    rng = random.Random(a.seed)
    prompts = a.prompts_per_rank * w
    plen = [rng.randint(64, 512) for _ in range(prompts)]
    rows = [(p, rng.randint(32, 1024)) for p in range(prompts) for _ in range(n)]  # rollout order
    whole = dedup(rows, plen)
    group_cost = max(call_cost([r for r in rows if r[0] == p], plen) for p in range(prompts))
    table = []
    for balance, make in (("openrlhf", openrlhf_calls), ("zorro", zorro_calls)):
        t0 = time.perf_counter()
        calls = make(rows, plen, w, a, a.seed)
        seconds = time.perf_counter() - t0
        for (batching, call), per_rank in sorted(calls.items()):
            flat = [c for r in per_rank for c in r]
            assert sorted(i for c in flat for i in c) == sorted(set(i for c in flat for i in c)), "a row in two calls"
            ds = [dedup([rows[i] for i in c], plen) for c in flat]
            costs = [sum(call_cost([rows[i] for i in c], plen) for c in r) for r in per_rank]
            holders: dict[int, int] = {}
            for c in flat:
                for p in {rows[i][0] for i in c}:
                    holders[p] = holders.get(p, 0) + 1
            mean = statistics.mean(ds)
            values = [
                w, prompts, n, batching, call, balance, len(flat), mean, min(ds), whole, mean / whole,
                max(costs) / statistics.mean(costs), max(costs) - min(costs), group_cost,
                sum(1 for v in holders.values() if v > 1), seconds,
            ]  # fmt: skip
            table.append({k: f"{x:.3f}" if isinstance(x, float) else x for k, x in zip(HEADER, values)})
    return table


def report(table: list[dict[str, Any]], a: argparse.Namespace) -> None:
    print(f"{'ranks':>5} {'n':>2} {'batching':8} {'call':8} {'balance':8} {'calls':>5} {'mean':>6} {'min':>6} {'ratio':>6} "
          f"{'max/mean':>8} {'spread':>7} {'group':>6} {'split':>5}")  # fmt: skip
    for r in table:
        print(f"{r['ranks']:>5} {r['n']:>2} {r['batching']:8} {r['call']:8} {r['balance']:8} {r['calls']:>5} "
              f"{r['mean_dedup']:>6} {r['min_dedup']:>6} {r['dedup_ratio']:>6} {r['rank_cost_max_over_mean']:>8} "
              f"{r['rank_cost_spread']:>7} {r['max_group_cost']:>6} {r['split_groups']:>5}")  # fmt: skip


BENCH = Benchmark(
    name="openrlhf_dp_dedup",
    doc=__doc__ or "",
    cases=cases,
    arms=("openrlhf", "zorro"),
    compute=compute,
    arguments=arguments,
    quick={"ranks": [2], "n": [4], "prompts_per_rank": 2},
    out="results/openrlhf_dp_dedup.csv",
    columns=HEADER,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
