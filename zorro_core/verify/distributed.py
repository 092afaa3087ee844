"""Prove the data-parallel path: regroup + an FSDP2-sharded deduplicated actor + restore equals
one process computing the whole batch.

Each rank holds a slice of a global batch dealt round-robin by group (so groups are cut across
ranks, as a trainer's shuffle cuts them). The model (float64, seeded identically on every rank) is
sharded with `fully_shard` on each decoder layer and on the CausalLM root. Every rank regroups
its rows, runs the deduplicated actor, restores log-probs and entropy to its own rows and takes
a loss over them normalised by the GLOBAL count of response tokens; then backward. FSDP reduces
the gradients with an explicit SUM (divide factor 1, sum-only collectives), so the result does
not depend on how a backend implements ReduceOp.AVG (gloo FSDP2 once summed where it should have
averaged). The full gradients (gathered from the shards) and every rank's restored log-probs
and entropies are compared with one process running each sequence of the global batch alone
through the unmodified model (zorro_core.verify.reference), same loss. RULE says the bar.

Planted bugs (`bug=`), each of which must fail: see BUGS.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.distributed import regroup
from zorro_core.distributed.launch import default_backend, init_from_env, launch, under_torchrun
from zorro_core.distributed.regroup import Exchange
from zorro_core.plan.balance import select_rows
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.prompt import group_rows
from zorro_core.verify.gradients import (
    GRAD_FLOOR,
    LP_FLOOR,
    TEMPERATURE,
    build_verify_model,
)
from zorro_core.verify.reference import per_sequence, token_weights

RULE = (
    "Pass rule. N ranks (gloo on CPU, NCCL on GPU), float64, the model sharded with fully_shard on each "
    "decoder layer and on the root; each rank regroups its slice of a global batch whose groups are cut "
    "across ranks, runs the deduplicated actor, restores log-probs and entropy to its own rows and "
    "backpropagates sum(w * log_prob + v * entropy) / (response tokens of the GLOBAL batch); FSDP reduces "
    "with an explicit sum. Reference: one process, each sequence of the global batch alone through the "
    f"unmodified model, same loss. Passes when |log-prob - ref| <= {LP_FLOOR:g} and |entropy - ref| <= "
    f"{LP_FLOOR:g} on every token of every rank, restore(responses) gives back every rank's own tokens "
    f"exactly, and ||grad - ref|| / ||ref|| <= {GRAD_FLOOR:g} for every parameter (full gradient "
    "gathered from the shards)."
)

BUGS: dict[str, str] = {
    "sum_loss": "the loss sums over tokens where a mean over the global batch is meant",
    "reduce_average": "FSDP averages gradients over ranks although the loss is already normalised over the global "
    "batch (off by the world size, as a backend that averaged where it should sum would be)",
    "restore_rank": "restore hands each rank the rows of the next rank",
    "restore_order": "restore puts a rank's values back in the wrong rows and columns (reversed)",
}


@dataclass
class DistributedConfig:
    """One distributed verification."""

    model: str = "tiny-qwen3"
    """Preset (tiny shapes of a supported family)."""
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(attn_implementation="sdpa"))
    """The options the actor runs with on every rank."""
    equal_rows: bool = False
    """regroup(equal_rows=...): same row count per rank, or whole groups."""
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL, one GPU per rank)."""
    seed: int = 0
    """Seeds weights, the batch and the loss weights."""
    bugs: tuple = (None,)
    """Variants to run in the same ranks: None (clean) and/or names from BUGS."""


@dataclass
class VariantResult:
    """One variant (clean or a planted bug), judged over every rank."""

    bug: str | None
    status: str
    """pass, fail or error."""
    reason: str = ""
    log_prob_err: float = float("nan")
    """max |log-prob - ref| over every rank's tokens."""
    entropy_err: float = float("nan")
    """max |entropy - ref|."""
    restore_exact: bool = False
    """restore(local responses) == each rank's own responses, on every rank."""
    worst_param: str = ""
    worst_grad_err: float = float("nan")
    """max over parameters of ||grad - ref|| / ||ref||."""
    ranks: list = field(default_factory=list)
    """Per rank: rows before/after, prompt dedup ratio before/after, bytes moved."""

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def distributed_batch(world: int, vocab_size: int, seed: int = 0) -> RolloutBatch:
    """4 * world rows: `world` prompts with 3 rows each and `world` lone rows; varied prompt and
    response lengths (padding on both sides)."""
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(1, vocab_size, (n,), generator=g).tolist()

    shared = [toks(5 + (i % 4)) for i in range(world)]
    prompts = [p for p in shared for _ in range(3)] + [toks(4 + (i % 3)) for i in range(world)]
    responses = [toks(1 + (i * 5) % 6) for i in range(len(prompts))]
    perm = torch.randperm(len(prompts), generator=g).tolist()
    return RolloutBatch.from_lists([prompts[i] for i in perm], [responses[i] for i in perm])


def rank_rows(batch: RolloutBatch, rank: int, world: int) -> list[int]:
    """The rows of `rank`: rows ordered by group, dealt round-robin (a group of >= 2 rows is cut)."""
    gor = group_rows(batch).tolist()
    order = sorted(range(batch.batch_size), key=lambda i: (gor[i], i))
    return sorted(order[rank::world])


def _shard(model) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def _sum_reduction(model, explicit_sum: bool) -> None:
    """Explicit sum (divide factor 1, sum-only collectives), or an average over the ranks."""
    factor = 1.0 if explicit_sum else float(dist.get_world_size())
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(factor)
            m.set_force_sum_reduction_for_comms(True)


def _bugged_restore(restore, bug: str | None):
    """restore with a planted bug (the real one otherwise)."""
    if bug == "restore_order":
        restore._home_index = restore._home_index.flip(0)
        return restore
    if bug == "restore_rank":
        return _RestoreToNextRank(restore)
    return restore


class _RestoreToNextRank:
    """The restore_rank bug: every rank's rows go to rank - 1, so rank r gets rank r+1's rows."""

    def __init__(self, restore) -> None:
        self.restore = restore
        self.info = restore.info

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        rank, world = dist.get_rank(), dist.get_world_size()
        out = self.restore(t)
        n = out.shape[0]
        send = [n if d == (rank - 1) % world else 0 for d in range(world)]
        recv = [n if s == (rank + 1) % world else 0 for s in range(world)]
        return Exchange.apply(out, send, recv, None)


def verify_rank(cfg: DistributedConfig) -> list[dict]:
    """Run every variant of `cfg` on this rank (inside an initialized process group); per-variant raw results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(cfg.device if cfg.device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    model: Any = build_verify_model(cfg.model, "cpu", cfg.seed)
    model.to(torch.float64)
    ref_model = copy.deepcopy(model)
    ref_model.set_attn_implementation("eager")  # transformers' public switch (already eager: build_verify_model)
    batch = distributed_batch(world, model.config.vocab_size, cfg.seed + 1)
    weights = token_weights(batch, seed=cfg.seed + 2)
    n_global = int(batch.response_mask.sum())
    ref_lp, ref_ent, ref_grads = per_sequence(ref_model, batch, TEMPERATURE, weights)
    ref_grads = {k: v / n_global for k, v in ref_grads.items()}
    del ref_model
    model.to(dev)
    _shard(model)
    actor = DeduplicatedActor(model=model, config=cfg.actor)
    rows = rank_rows(batch, rank, world)
    mine = select_rows(batch, rows).to(dev)
    w_lp, w_ent = (w[rows].to(dev) for w in weights)
    out = []
    for bug in cfg.bugs:
        t0 = time.perf_counter()
        _sum_reduction(model, explicit_sum=bug != "reduce_average")
        model.zero_grad(set_to_none=True)
        local, restore = regroup(mine, equal_rows=cfg.equal_rows)
        restore_exact = bool(
            torch.equal(restore(local.responses * local.response_mask), mine.responses * mine.response_mask)
        )
        restore = _bugged_restore(restore, bug)
        res = actor.forward(local, temperature=TEMPERATURE, calculate_entropy=True)
        lp, ent = restore(res.log_probs), restore(res.entropy)
        loss = (w_lp * lp).sum() + (w_ent * ent).sum()
        if bug != "sum_loss":
            loss = loss / n_global
        loss.backward()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().cpu()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        info = restore.info
        out.append(
            {
                "bug": bug,
                "rank": rank,
                "log_prob_err": (lp.detach().cpu() - ref_lp[rows]).abs().max().item(),
                "entropy_err": (ent.detach().cpu() - ref_ent[rows]).abs().max().item(),
                "restore_exact": restore_exact,
                "grad_errs": _rel_errors(grads, ref_grads),
                "rows_before": info.rows_before[rank],
                "rows_after": info.rows_after[rank],
                "prompt_dedup_before": info.prompt_dedup_before[rank],
                "prompt_dedup_after": info.prompt_dedup_after[rank],
                "split_groups_after": info.split_groups_after,
                "bytes_sent": info.bytes_sent,
                "restore_bytes_sent": info.restore_bytes_sent,
                "seconds": time.perf_counter() - t0,
            }
        )
    return out


def _rel_errors(grads: dict, ref: dict) -> dict:
    out = {}
    for n, g_ref in ref.items():
        if n not in grads:
            out[n] = math.inf
            continue
        denom = g_ref.norm().item()
        err = (grads[n].double() - g_ref.double()).norm().item()
        out[n] = err / denom if denom > 0 else err
    for n in set(grads) - set(ref):
        out[n] = math.inf
    return out


def judge(per_rank: list[list[dict]]) -> list[VariantResult]:
    """Combine every rank's raw results into one verdict per variant (RULE)."""
    results = []
    for variant in zip(*per_rank):
        bug = variant[0]["bug"]
        lp = max(v["log_prob_err"] for v in variant)
        ent = max(v["entropy_err"] for v in variant)
        grads: dict[str, float] = {}
        for v in variant:
            for n, e in v["grad_errs"].items():
                grads[n] = max(grads.get(n, 0.0), e)
        worst = max(grads, key=lambda p: grads[p]) if grads else ""
        failing = []
        if not lp <= LP_FLOOR:
            failing.append(f"log-prob {lp:.2e} > {LP_FLOOR:g}")
        if not ent <= LP_FLOOR:
            failing.append(f"entropy {ent:.2e} > {LP_FLOOR:g}")
        exact = all(v["restore_exact"] for v in variant)
        if not exact:
            failing.append("restore(responses) differs from a rank's own responses")
        if not grads or not grads[worst] <= GRAD_FLOOR:
            failing.append(f"grad {worst} {grads.get(worst, math.nan):.2e} > {GRAD_FLOOR:g}")
        ranks = [
            {
                k: v[k]
                for k in (
                    "rank",
                    "rows_before",
                    "rows_after",
                    "prompt_dedup_before",
                    "prompt_dedup_after",
                    "bytes_sent",
                    "restore_bytes_sent",
                    "seconds",
                )
            }
            for v in variant
        ]
        results.append(
            VariantResult(
                bug,
                "fail" if failing else "pass",
                "; ".join(failing),
                lp,
                ent,
                exact,
                worst,
                grads.get(worst, math.nan),
                ranks,
            )
        )
    return results


def verify_distributed(cfg: DistributedConfig, nproc: int = 2, join_timeout_s: float = 300.0) -> list[VariantResult]:
    """Spawn `nproc` ranks (or, under torchrun, join its ranks, waiting at most `join_timeout_s`
    for them), run every variant, judge on every rank."""

    unknown = [b for b in cfg.bugs if b is not None and b not in BUGS]
    if unknown:
        raise ValueError(f"unknown bug(s) {unknown}; choose from {sorted(BUGS)}")
    if under_torchrun():
        init_from_env(default_backend(cfg.device), timeout_s=join_timeout_s)
        mine = verify_rank(cfg)
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        dist.destroy_process_group()
        return judge(per_rank)
    return judge(launch(verify_rank, nproc, cfg, backend=default_backend(cfg.device)))
