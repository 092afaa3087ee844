"""Per-call prompt dedup that OpenRLHF 0.11's own micro-batching leaves each DP rank, fixed and dynamic.

    DS_ACCELERATOR=cpu PYTHONPATH=. .venv-openrlhf/bin/python benchmarks/openrlhf_dp_dedup.py [--ranks 2
        --prompts 16 --n 8 --seed 0 --out results/openrlhf_dp_dedup.csv]

No model runs: rows are (prompt length, response length) pairs, n siblings per prompt in rollout order.
The partitions are made by OpenRLHF's own functions where it has them, in the order its trainer applies them:
- log-prob calls (old / reference, `PolicyModelActor.forward`): `split_rollout_samples` (fixed: contiguous
  chunks of `rollout.micro_batch_size`; dynamic: `get_seqlen_balanced_partitions` over total lengths into
  a multiple of the ranks, as many as `get_minimum_num_micro_batch_size` needs under
  `rollout.max_tokens_per_gpu`), then `RayActorGroup.async_run_method_batch` (contiguous chunks of those
  micro-batches per rank).
- training calls (`ActorPPOTrainer.training_step`): fixed: the rank's contiguous share of the rollout, its
  replay buffer read by a shuffled DataLoader in `train.micro_batch_size` rows (torch's RandomSampler, as
  `ppo_train` builds it); dynamic: `balance_experiences` (sort by length, interleave) across ranks, then
  each rank's `setup_dynamic_batch` partitions (`get_seqlen_balanced_partitions`, `train.max_tokens_per_gpu`).
The figure per call is zorro's prompt dedup ratio: 1 - unique prompt tokens / prompt tokens of the call's rows.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def dedup(rows, plen):
    prompts = [r[0] for r in rows]
    total = sum(plen[p] for p in prompts)
    return 1.0 - sum(plen[p] for p in set(prompts)) / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rollout-micro", type=int, default=16, help="rollout.micro_batch_size")
    ap.add_argument("--train-micro", type=int, default=8, help="train.micro_batch_size")
    ap.add_argument("--max-tokens", type=int, default=8192, help="rollout/train.max_tokens_per_gpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/openrlhf_dp_dedup.csv")
    args = ap.parse_args()

    import openrlhf_setup  # noqa: F401  (the flash-attn stand-in before OpenRLHF imports)
    from openrlhf.trainer.ppo_utils.experience import Experience, balance_experiences
    from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size, get_seqlen_balanced_partitions

    rng = random.Random(args.seed)
    plen = [rng.randint(64, 512) for _ in range(args.prompts)]
    rows = [(p, rng.randint(32, 1024)) for p in range(args.prompts) for _ in range(args.n)]  # rollout order
    total = [plen[p] + r for p, r in rows]
    w = args.ranks
    out: list[tuple[str, str, int, float]] = []  # (path, batching, rank, dedup of one call)

    def to_ranks(micro):  # async_run_method_batch: contiguous chunks of the micro-batch list per rank
        size = -(-len(micro) // w)
        return [micro[i * size : (i + 1) * size] for i in range(w)]

    # log-prob calls
    fixed = [list(range(i, min(i + args.rollout_micro, len(rows)))) for i in range(0, len(rows), args.rollout_micro)]
    need = get_minimum_num_micro_batch_size(total, args.max_tokens, 1, 1) // w * w
    dyn = get_seqlen_balanced_partitions(total, max(need, w), False)
    for name, micro in (("fixed", fixed), ("dynamic", dyn)):
        for rank, calls in enumerate(to_ranks(micro)):
            out += [("logprob", name, rank, dedup([rows[i] for i in c], plen)) for c in calls]

    # training calls, fixed: each rank's share (what its log-prob calls held), shuffled into micro-batches
    g = torch.Generator().manual_seed(args.seed)
    for rank, calls in enumerate(to_ranks(fixed)):
        mine = [i for c in calls for i in c]
        order = [mine[j] for j in torch.randperm(len(mine), generator=g).tolist()]
        for s in range(0, len(order) - args.train_micro + 1, args.train_micro):  # drop_last=True
            out.append(("train", "fixed", rank, dedup([rows[i] for i in order[s : s + args.train_micro]], plen)))
    # training calls, dynamic: OpenRLHF's balance_experiences on the experiences of the log-prob micro-batches
    exps = []
    for c in dyn:
        exps.append(
            Experience(
                sequences=torch.zeros((len(c), 1), dtype=torch.long),
                total_length=torch.tensor([total[i] for i in c]),
                index=list(c),
                info={"row": torch.tensor(list(c))},
            )
        )
    ns = argparse.Namespace
    cfg = ns(actor=ns(num_nodes=1, num_gpus_per_node=w), ds=ns(ring_attn_size=1, tensor_parallel_size=1))
    per_rank = balance_experiences(exps, cfg)
    for rank, exp in enumerate(per_rank):
        ids = [int(x) for x in exp.info["row"]]
        lengths = [total[i] for i in ids]
        k = get_minimum_num_micro_batch_size(lengths, args.max_tokens, 1, 1)
        for part in get_seqlen_balanced_partitions(lengths, k, equal_size=False):
            out.append(("train", "dynamic", rank, dedup([rows[ids[j]] for j in part], plen)))

    whole = dedup(rows, plen)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["path", "batching", "rank", "calls", "mean_dedup", "min_dedup", "max_dedup", "rollout_dedup"])
        print(f"{args.prompts} prompts x {args.n}, {w} ranks; dedup of the whole rollout {whole:.3f}")
        for path in ("logprob", "train"):
            for name in ("fixed", "dynamic"):
                for rank in range(w):
                    xs = [d for p, b, r, d in out if (p, b, r) == (path, name, rank)]
                    row = [path, name, rank, len(xs), statistics.mean(xs), min(xs), max(xs), whole]
                    wr.writerow([*row[:4], *(f"{x:.3f}" for x in row[4:])])
                    print(
                        f"{path:8s} {name:8s} rank {rank}: {len(xs)} calls, dedup mean {row[4]:.3f} "
                        f"[{row[5]:.3f}, {row[6]:.3f}]"
                    )


if __name__ == "__main__":
    main()
