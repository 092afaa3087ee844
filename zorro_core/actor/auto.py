"""schedule="auto": the prompt-once schedule where it computes fewer FLOPs than the within-micro-batch
path and its counted peak is at most that path's at the same budget; else the within-micro-batch path.

Both figures are counted from the step's layout, nothing runs:
- FLOPs: the cost model's forward+backward (zorro_core.plan.cost) of each path's micro-batches:
  the within path's partition at the budget, each micro-batch's dedup plan (a prompt once per
  micro-batch holding its responses); the schedule's waves, each wave's dedup plan (each prompt once
  per step; its responses against the kept keys cost the same pairs).
- the peak: bytes autograd keeps alive, counted per token from the cost model's ModelShape
  (`TokenBytes`), beside the weights, gradients and optimizer state (equal in both paths). The
  within path holds one micro-batch's graph at a time (its largest). The schedule holds a wave's
  phase-1 residents (its graph: every layer's saved tensors, or under gradient checkpointing each
  layer's input) with the kept keys and values and their gradients, plus one response micro-batch's
  graph; in phase 3, under checkpointing, one layer of a phase-1 chunk recomputed instead.
It is a count, not a measurement: per decoder layer and token it counts the layer's input, the
attention's query, keys, values and output, the post-attention norm's input and the MLP's gate, up
and product (the tensors flash-attention-style kernels and a gated MLP save), and the logits in the
actor's logits mode. `zorro bench memory --budget` counts the same paths by running them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from zorro_core.actor.token_bytes import TokenBytes, checkpointing_on, schedule_peak, within_peak
from zorro_core.plan.batch import RolloutBatch

__all__ = ["ScheduleChoice", "TokenBytes", "checkpointing_on", "choose_schedule", "schedule_peak", "within_peak"]


@dataclass(frozen=True)
class ScheduleChoice:
    """What schedule="auto" chose for a step, and why."""

    schedule: str
    """"prompt_once" or "micro_batch"."""
    reason: str
    """The comparison that decided it, in words."""
    flops_micro_batch: float
    """The within path's forward+backward FLOPs (cost model)."""
    flops_prompt_once: float
    """The schedule's."""
    peak_micro_batch: float
    """The within path's counted peak, bytes (TokenBytes)."""
    peak_prompt_once: float
    """The schedule's."""

    def metrics(self) -> dict[str, float]:
        """The choice as numbers (a trainer's metrics): 1.0 for the schedule, the FLOP and peak ratios."""
        return {
            "zorro/auto_prompt_once": 1.0 if self.schedule == "prompt_once" else 0.0,
            "zorro/auto_flops_ratio": self.flops_prompt_once / self.flops_micro_batch
            if self.flops_micro_batch
            else 0.0,
            "zorro/auto_peak_ratio": self.peak_prompt_once / self.peak_micro_batch if self.peak_micro_batch else 0.0,
        }


def choose_schedule(
    actor: Any,
    batch: RolloutBatch,
    max_tokens: Optional[int],
    wave_tokens: Optional[int] = None,
    within_parts: Optional[Sequence[Sequence[int]]] = None,
    schedule_parts: Optional[Sequence[Sequence[int]]] = None,
) -> ScheduleChoice:
    """The choice of schedule="auto" for `batch` at the budget (module doc). `within_parts` and
    `schedule_parts`: each path's micro-batches when the trainer fixes them (default: the library's
    at the budget)."""
    from zorro_core.actor.microbatch import micro_batch_partition
    from zorro_core.actor.schedule import Groups, PromptNodes, phase1_cuts, plan_batch_waves, schedule_refusal
    from zorro_core.actor.self_check import compute_dtype
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.balance import select_rows
    from zorro_core.plan.cost import flops, plan_workload

    refusal = schedule_refusal(actor)
    mode = actor.config.logits_mode
    shape = model_shape(actor.model.config)
    tb = TokenBytes.of(shape, compute_dtype(actor), checkpointing_on(actor.model), mode)

    def cost(rows: Sequence[int]) -> float:
        return flops(shape, plan_workload(actor.plan(select_rows(batch, rows)), mode)).forward_backward

    if within_parts is None:
        within_parts = micro_batch_partition(actor, batch, max_tokens).parts
    rmask = batch.response_mask.bool()
    within_tokens, within_logits = [], []
    for part in within_parts:
        plan = actor.plan(select_rows(batch, part))
        within_tokens.append(int(plan.num_tokens))
        n_responses = int(rmask[list(part)].sum())
        within_logits.append(int(plan.num_tokens) if mode == "none" else n_responses)
    flops_mb = sum(cost(p) for p in within_parts)
    peak_mb = within_peak(tb, within_tokens, within_logits)
    if refusal is not None:
        return ScheduleChoice(
            "micro_batch", f"the schedule does not serve this actor: {refusal}", flops_mb, 0.0, peak_mb, 0.0
        )

    groups = Groups.of(batch)
    nodes = PromptNodes.of(groups.prompts, actor.config.sharing, torch.device("cpu"))
    bound = wave_tokens if wave_tokens is not None else max_tokens
    plans = plan_batch_waves(groups, nodes, max_tokens, bound, schedule_parts)
    linear = actor.parts.num_linear_layers > 0
    chunks = [b - a for p in plans for a, b in phase1_cuts(p.prompt_tokens, max_tokens, None, linear)]
    responses = [int(rmask[part].sum()) for p in plans for part in p.parts]
    flops_po = sum(cost(p.rows) for p in plans)
    peak_po = schedule_peak(tb, [p.prompt_tokens for p in plans], chunks, responses)
    figures = (flops_mb, flops_po, peak_mb, peak_po)
    gib = 2.0**30
    if flops_po >= flops_mb:
        why = (
            f"the schedule computes no fewer FLOPs ({flops_po:.3g} vs {flops_mb:.3g}: no group is split across "
            "the within path's micro-batches)"
        )
        return ScheduleChoice("micro_batch", why, *figures)
    if peak_po > peak_mb:
        why = (
            f"the schedule's counted peak {peak_po / gib:.3g} GiB is over the within path's {peak_mb / gib:.3g} GiB "
            f"(it would compute {flops_mb / flops_po:.2f}x fewer FLOPs)"
        )
        return ScheduleChoice("micro_batch", why, *figures)
    why = (
        f"{flops_mb / flops_po:.2f}x fewer FLOPs and a counted peak of {peak_po / gib:.3g} GiB <= the within "
        f"path's {peak_mb / gib:.3g} GiB"
    )
    return ScheduleChoice("prompt_once", why, *figures)
