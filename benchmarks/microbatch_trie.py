"""Micro-batches of a sharing="prefix" batch: cut along the trie vs by prompt group (CPU, one thread).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/microbatch_trie.py [--repeats 7] [--preset small-qwen3]

8 groups x 4 responses: a 512-token system prompt shared by every group, a 64-token user turn per
group, 64-token responses; budget = two groups' tokens by prompt (2 x (576 + 4 x 64) = 1,664).
Both arms run the same prefix-sharing actor and the same accumulation loop; only the partition
differs: "trie" is what `forward_backward` runs now (zorro_core.plan.trie_balance), "prompt" the
prompt-group partition it ran before (zorro_core.plan.balance.partition_micro_batches). Prints
each arm's micro-batches, computed tokens, the cost model's forward+backward FLOPs (and the ideal
speedup they imply), and the forward+backward time: runs interleaved, median and min-max, and the
ratio of each round's two runs (robust to load that drifts between rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from zorro_core import DeduplicatedActor, create_dummy_batch
from zorro_core.actor.microbatch import micro_batch_partition
from zorro_core.models.presets import load_model
from zorro_core.models.registry import model_shape
from zorro_core.plan.balance import GroupedLengths, partition_micro_batches, select_rows
from zorro_core.plan.cost import flops, plan_workload
from zorro_core.plan.trie_balance import TrieLengths, partition_trie_micro_batches


def accumulate(actor, batch, parts, weights, n):
    """One forward+backward per micro-batch, gradients accumulated (forward_backward's loop)."""
    plans = []
    for rows in parts:
        idx = torch.tensor(rows)
        out = actor.forward(select_rows(batch, idx))
        ((weights[idx] * out.log_probs).sum() / n).backward()
        plans.append(out.plan)
    return plans


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--preset", default="small-qwen3")
    args = ap.parse_args()
    torch.set_num_threads(1)
    groups, size, system, user, resp = 8, 4, 512, 64, 64
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
    arms = {
        "trie": partition_trie_micro_batches(TrieLengths.of(batch, actor.config.min_shared_tokens), budget).parts,
        "prompt": partition_micro_batches(GroupedLengths.of(batch), budget).parts,
    }
    assert arms["trie"] == micro_batch_partition(actor, batch, budget, 0.0).parts  # what forward_backward runs
    weights = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(0))
    n = batch.response_mask.sum()
    shape = model_shape(model.config)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    fb: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for rep in range(args.repeats + 1):  # the first round warms up
        for arm, parts in arms.items():
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            plans = accumulate(actor, batch, parts, weights, n)
            if rep:
                times[arm].append(time.perf_counter() - t)
            tokens[arm] = sum(p.num_tokens for p in plans)
            fb[arm] = sum(flops(shape, plan_workload(p)).forward_backward for p in plans)
    whole = actor.plan(batch)
    print(
        f"{args.preset} float32, 1 thread, {groups} groups x {size}, system {system}, user {user}, "
        f"responses {resp}, budget {budget} tokens; one pass over the whole batch: {whole.num_tokens:,} tokens"
    )
    for arm, parts in arms.items():
        med = statistics.median(times[arm])
        print(
            f"{arm:7s} {len(parts)} micro-batches  {tokens[arm]:6,} tokens  {fb[arm] / 1e9:7.2f} GFLOP fwd+bwd  "
            f"{med:6.3f} s (min {min(times[arm]):.3f}, max {max(times[arm]):.3f}, n={len(times[arm])})"
        )
    paired = sorted(p / t for p, t in zip(times["prompt"], times["trie"]))  # each round's two runs, back to back
    print(
        f"trie vs prompt: tokens {tokens['prompt'] / tokens['trie']:.3f}x, ideal (cost model, fwd+bwd FLOPs) "
        f"{fb['prompt'] / fb['trie']:.3f}x, measured: medians {statistics.median(times['prompt']) / statistics.median(times['trie']):.3f}x, "
        f"per round median {statistics.median(paired):.3f}x (min {paired[0]:.3f}, max {paired[-1]:.3f})"
    )


if __name__ == "__main__":
    main()
