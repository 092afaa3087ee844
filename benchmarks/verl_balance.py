"""verl's actor update on 2 data-parallel ranks (gloo, CPU): verl's balance vs zorro's, each against
verl's own engine, beside the cost model's ideal.

    .ci/verl_tests --collect-only -q >/dev/null   # once: makes the verl venv
    PYTHONPATH=$PWD .venv-verl/bin/python benchmarks/verl_balance.py [--prompts 4 --responses 8
        --prompt-len 256 --response-len 32 --preset small-qwen3 --repeats 3 --out results/verl_balance.csv]

Arms, each the actor update of one step (verl's `forward_backward_batch` with verl's `ppo_loss`
and backward, FSDP2 over both ranks, float32, verl's padded sdpa path as in
`benchmarks/verl_engine.py`, one micro-batch per rank holding all its rows):
- `verl`: verl's `FSDPEngineWithLMHead` on the rows verl's V1 balance gives each rank
  (`get_seqlen_balanced_partitions(calculate_workload(seq_len), equal_size=True)`);
- `zorro_engine+verl_balance`: zorro's engine on the same rows (groups split across ranks);
- `zorro_engine+zorro_balance`: zorro's engine on the rows the "zorro_sync" trainer's balance
  gives each rank (`zorro_core.integrations.verl.balance`: whole groups per rank).
Rows arrive shuffled, as rollouts do. The step's time is the slower rank's (FSDP's collectives
make the ranks wait for each other); arms alternate after one warm-up round (zorro_harness.bench.arms,
the order reversed every round); medians are reported
with the per-rank prompt dedup each partition leaves, and the ideal from `zorro_core.plan.cost`
(FLOPs of linear layers, attention pairs and lm_head; verl computes logits at every token, zorro
only at response tokens; training = 3 x forward) of the slower rank against verl's slower rank.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, main, time_arms
from zorro_harness.bench.measure import self_timed

ARMS = ("verl", "zorro_engine+verl_balance", "zorro_engine+zorro_balance")
BALANCE_OF = {"verl": "verl", "zorro_engine+verl_balance": "verl", "zorro_engine+zorro_balance": "zorro"}


def make_rows(args, vocab: int):
    import torch

    g = torch.Generator().manual_seed(args.seed)
    prompts, responses, uids = [], [], []
    for u in range(args.prompts):
        prompt = torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.responses):
            n = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(2, vocab, (n,), generator=g).tolist())
            uids.append(u)
    order = torch.randperm(len(prompts), generator=g).tolist()
    return [prompts[i] for i in order], [responses[i] for i in order], [uids[i] for i in order]


def partitions(prompts, responses, uids, dp: int) -> dict[str, list[list[int]]]:
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    from zorro_core.integrations.verl.balance import balance_rows

    seqlen = torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses)])
    verl_parts = get_seqlen_balanced_partitions(calculate_workload(seqlen), k_partitions=dp, equal_size=True)
    ours = balance_rows(uids, [len(p) for p in prompts], [len(r) for r in responses], dp).ranks
    return {"verl": [sorted(p) for p in verl_parts], "zorro": ours}


def rank_figures(shape, prompts, responses, uids, rows):
    """(prompt dedup, verl FLOPs, zorro FLOPs) of one rank's rows, training (3 x forward)."""
    from zorro_core.plan.cost import ForwardWork, flops, shape_workloads

    by_group: dict[int, list[int]] = {}
    for i in rows:
        by_group.setdefault(uids[i], []).append(len(responses[i]))
    plen = {uids[i]: len(prompts[i]) for i in rows}
    base, dedup = shape_workloads(
        [plen[u] for u in by_group], [len(v) for v in by_group.values()], list(by_group.values())
    )
    logical = sum(len(prompts[i]) for i in rows)
    d = 1 - sum(plen.values()) / logical
    base_all = ForwardWork(base.tokens, base.attended_pairs, base.tokens)
    return d, flops(shape, base_all, "none").forward_backward, flops(shape, dedup, "compute").forward_backward


def rank_main(args, path: str) -> dict:
    import torch
    import torch.distributed as dist

    from zorro_core.integrations.verl.cpu import build_engine, engine_batch, padded_batch, use_cpu_platform

    use_cpu_platform()
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPActorConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    from zorro_core.integrations.verl.engine import DedupFSDPEngine
    from zorro_core.models.presets import preset_config

    torch.set_num_threads(args.threads)
    rank, dp = dist.get_rank(), dist.get_world_size()
    config = preset_config(args.preset)
    prompts, responses, uids = make_rows(args, config.vocab_size)
    padded = padded_batch(prompts, responses, seed=args.seed)
    parts = partitions(prompts, responses, uids, dp)
    per_rank = len(prompts) // dp
    engines = {
        "verl": build_engine(FSDPEngineWithLMHead, path, precision="fp32", use_remove_padding=False),
        "zorro": build_engine(DedupFSDPEngine, path, precision="fp32", use_remove_padding=False),
    }
    loss_fn = functools.partial(
        ppo_loss,
        config=FSDPActorConfig(
            strategy="fsdp2", rollout_n=args.responses, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=per_rank
        ),
    )
    arms = {
        "verl": ("verl", "verl"),
        "zorro_engine+verl_balance": ("zorro", "verl"),
        "zorro_engine+zorro_balance": ("zorro", "zorro"),
    }

    def step(arm: str) -> float:
        engine_name, balance = arms[arm]
        engine = engines[engine_name]
        sub = tu.index_select_tensor_dict(padded, torch.as_tensor(parts[balance][rank]))
        data = engine_batch(
            sub,
            temperature=1.0,
            calculate_entropy=True,
            use_remove_padding=False,
            micro_batch_size_per_gpu=per_rank,
            global_batch_size=len(prompts),
        )
        dist.barrier()
        t0 = time.perf_counter()
        engine.optimizer_zero_grad()
        with engine.train_mode(disable_auto_offload=True):
            engine.forward_backward_batch(data, loss_fn, forward_only=False)
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step waits for the slower rank
        return float(elapsed)

    samples = time_arms({arm: functools.partial(step, arm) for arm in arms}, args.rounds, args.warmup, clock=self_timed)
    return {"samples": dict(samples.samples), "parts": parts}


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--responses", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case("actor_update", {})]


def compute(context: None, case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from zorro_core.distributed.launch import launch
    from zorro_core.integrations.verl.cpu import save_model
    from zorro_core.models.presets import build_model, preset_config
    from zorro_core.models.registry import model_shape

    config = preset_config(args.preset)
    path = f"/tmp/zorro_verl_bench_{args.preset}"
    if not os.path.isdir(path):
        save_model(build_model(config, dtype=torch.float32, attn_implementation="sdpa", seed=0), path)
    out = launch(rank_main, 2, args, path, threads=args.threads, timeout_s=3000)[0]
    samples, parts = out["samples"], out["parts"]
    prompts, responses, uids = make_rows(args, config.vocab_size)
    shape = model_shape(config)
    figures = {b: [rank_figures(shape, prompts, responses, uids, rows) for rows in parts[b]] for b in parts}
    verl_flops = max(f[1] for f in figures["verl"])
    ideal = {
        "verl": 1.0,
        "zorro_engine+verl_balance": verl_flops / max(f[2] for f in figures["verl"]),
        "zorro_engine+zorro_balance": verl_flops / max(f[2] for f in figures["zorro"]),
    }
    base = statistics.median(samples["verl"]) / 1e3
    batch_dedup = 1 - args.prompts / len(prompts)
    rows = []
    for arm in ARMS:
        xs = [ms / 1e3 for ms in samples[arm]]
        dedup = [f[0] for f in figures[BALANCE_OF[arm]]]
        med = statistics.median(xs)
        rows.append(
            {
                "arm": arm,
                "median_s": f"{med:.4f}",
                "min_s": f"{min(xs):.4f}",
                "max_s": f"{max(xs):.4f}",
                "n": len(xs),
                "speedup_vs_verl": f"{base / med:.3f}",
                "ideal": f"{ideal[arm]:.3f}",
                "dedup_rank0": f"{dedup[0]:.3f}",
                "dedup_rank1": f"{dedup[1]:.3f}",
                "batch_dedup": f"{batch_dedup:.3f}",
            }
        )
    return rows


def meta(args: argparse.Namespace) -> dict[str, Any]:
    import datetime

    import torch
    import verl

    return {
        "verl": verl.__version__,
        "torch": torch.__version__,
        "host": platform.node(),
        "threads_per_rank": args.threads,
        "ranks": 2,
        "preset": args.preset,
        "shape": f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"{args.prompts}x{args.responses} P={args.prompt_len} R<={args.response_len}, {args.preset}, 2 ranks x {args.threads} threads"
    )
    for r in rows:
        print(
            f"{r['arm']}: {r['median_s']} s [{r['min_s']}, {r['max_s']}], {r['speedup_vs_verl']}x verl's engine "
            f"(ideal {r['ideal']}x); per-rank prompt dedup {r['dedup_rank0']}, {r['dedup_rank1']} (batch {r['batch_dedup']})"
        )


BENCH = Benchmark(
    name="verl_balance",
    doc=__doc__ or "",
    cases=cases,
    arms=ARMS,
    compute=compute,
    arguments=arguments,
    quick={"responses": 2, "prompt_len": 16, "response_len": 8, "rounds": 1},
    rounds=3,
    out="results/verl_balance.csv",
    columns=(
        "arm",
        "median_s",
        "min_s",
        "max_s",
        "n",
        "speedup_vs_verl",
        "ideal",
        "dedup_rank0",
        "dedup_rank1",
        "batch_dedup",
    ),  # fmt: skip
    meta=meta,
    report=report,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
