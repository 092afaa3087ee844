"""Gradient accumulation over balanced micro-batches of one batch.

Loss normalisation: gradients add up over micro-batches, so the accumulated gradient equals
the full batch's exactly when the loss is a sum over rows. Make `loss_fn` return a SUM of
per-token (or per-row) terms scaled by constants of the FULL batch, e.g.
    n = batch.response_mask.sum()                     # computed once, over the whole batch
    loss_fn = lambda out, rows: -(adv[rows] * out.log_probs * mask[rows]).sum() / n
(token-mean over the batch), or divide per-row sums by each row's length and by B
(sequence-mean). A per-micro-batch mean would weight the micro-batches wrongly.

Micro-batches, by the type of the plans the actor builds: for a `PromptPlan` (sharing="prompt",
and the baseline) each prompt's rows stay together (zorro_core.plan.balance); for a `TriePlan`
(sharing="prefix") the batch is cut along its token trie, each micro-batch a run of rows in trie
order costed by its own plan (zorro_core.plan.trie_balance). The budget is in computed tokens
either way.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from zorro_core.actor.config import ActorConfig
from zorro_core.plan.balance import (
    GroupedLengths,
    Partition,
    check_attention_weight,
    partition_micro_batches,
    select_rows,
)
from zorro_core.plan.batch import RolloutBatch, check_batch
from zorro_core.plan.build import plan_type
from zorro_core.plan.prompt import PromptPlan
from zorro_core.plan.trie import TriePlan
from zorro_core.plan.trie_balance import TrieLengths, partition_trie_micro_batches


class LogProbActor(Protocol):
    """What forward_backward needs of an actor (zorro_core.actor.actor's actors are ones)."""

    dedup: bool
    device: torch.device
    config: ActorConfig

    @property
    def vocab_size(self) -> int: ...

    def forward(self, batch: RolloutBatch, temperature: float = 1.0, calculate_entropy: bool = False) -> Any:
        """An ActorOutput: .log_probs and .entropy in the batch's [B, R] layout."""


@dataclass
class MicroBatchOutput:
    """What `forward_backward` leaves besides the accumulated `.grad`s."""

    log_probs: torch.Tensor
    """[B, R] log-probs in the batch's original row order, detached; 0 at padding."""
    entropy: Optional[torch.Tensor]
    """[B, R] entropy, detached, or None."""
    loss: float
    """Sum of the micro-batch losses."""
    partition: Partition
    """The micro-batches (row indices), their tokens and costs, splits and imbalance."""
    schedule_choice: Optional[Any] = None
    """Under schedule="auto": the choice and its reason (zorro_core.actor.auto.ScheduleChoice)."""


def forward_backward(
    actor: LogProbActor,
    batch: RolloutBatch,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    max_tokens_per_micro_batch: Optional[int] = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    attention_weight: float = 0.0,
) -> MicroBatchOutput:
    """Forward and backward each micro-batch in turn, accumulating into the parameters' `.grad`.

    `loss_fn(out, rows)` gets the micro-batch's ActorOutput ([b, R], rows in the order of
    `rows`, a 1-D long tensor of indices into the full batch) and returns a scalar (see the
    module doc for normalisation). `.grad` is accumulated, not reset: zero it before.
    """
    check_batch(batch, "forward_backward")
    if not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a callable loss_fn(out, rows) -> scalar tensor, got {type(loss_fn).__name__} {loss_fn!r}"
        )
    check_budget(max_tokens_per_micro_batch)
    check_attention_weight(attention_weight)
    if not torch.is_grad_enabled():
        raise ValueError(
            "forward_backward needs gradients: it was called under torch.no_grad() or torch.inference_mode() "
            "(use actor.forward there)"
        )
    batch.check_vocab(actor.vocab_size)  # before any backward: a bad id must not leave partial gradients
    batch = batch.to(actor.device)
    part = micro_batch_partition(actor, batch, max_tokens_per_micro_batch, attention_weight)
    b, r = batch.responses.shape
    log_probs = entropy = None
    total = 0.0
    # Parameters without a gradient before the call get none back if a micro-batch fails (free: no
    # copy); existing gradients would need a copy as large as them, so the error says what they hold.
    fresh = [p for p in _parameters(actor) if p.grad is None]
    done = 0
    try:
        for rows in part.parts:
            idx = torch.tensor(rows, dtype=torch.long, device=batch.device)
            out = actor.forward(select_rows(batch, idx), temperature=temperature, calculate_entropy=calculate_entropy)
            loss = loss_fn(out, idx)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn must return a scalar tensor")
            if not loss.requires_grad:
                raise ValueError(
                    "loss_fn returned a loss that does not require grad (detached, or computed without the "
                    "output's log-probs or entropy)"
                )
            loss.backward()
            done += 1
            total += float(loss.detach())
            if log_probs is None:
                log_probs = out.log_probs.new_zeros(b, r)
                entropy = out.log_probs.new_zeros(b, r) if out.entropy is not None else None
            log_probs[idx] = out.log_probs.detach()
            if entropy is not None:
                entropy[idx] = out.entropy.detach()
    except BaseException as e:
        _undo(e, fresh, done, len(part.parts), actor)
        raise
    if log_probs is None:  # unreachable: a validated batch has rows, so some micro-batch ran
        raise ValueError("the batch has no rows")
    return MicroBatchOutput(log_probs, entropy, total, part)


def check_budget(max_tokens: object) -> None:
    """Refuse a micro-batch budget that is not None or an int >= 1 (a bool, a float, a string)."""
    if max_tokens is None:
        return
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 1:
        raise ValueError(
            f"max_tokens_per_micro_batch must be an int >= 1 or None, got {type(max_tokens).__name__} {max_tokens!r}"
        )


def _parameters(actor: LogProbActor) -> list[torch.Tensor]:
    model = getattr(actor, "model", None)
    return list(model.parameters()) if model is not None else []


def _undo(error: BaseException, fresh: list[torch.Tensor], done: int, parts: int, actor: LogProbActor) -> None:
    """After a failed micro-batch: parameters that had no gradient get none back; the error says
    what the others hold."""
    for p in fresh:
        p.grad = None
    kept = [p for p in _parameters(actor) if p.grad is not None]
    if kept and done and hasattr(error, "add_note"):
        error.add_note(
            f"zorro: forward_backward failed in micro-batch {done + 1} of {parts}; the gradients that existed "
            f"before the call now also hold micro-batch {'1' if done == 1 else f'1..{done}'}'s (model.zero_grad() "
            "before retrying)"
        )


def micro_batch_partition(
    actor: LogProbActor, batch: RolloutBatch, max_tokens: Optional[int] = None, attention_weight: float = 0.0
) -> Partition:
    """The micro-batches `forward_backward` runs, by the type of the plans the actor builds: for a
    `TriePlan` cut along the trie, so a prefix shared by every group is computed once per
    micro-batch, not once per group (zorro_core.plan.trie_balance); for a `PromptPlan` by prompt
    group (zorro_core.plan.balance)."""
    kind = plan_type(actor.dedup, actor.config.sharing)
    return _partition.dispatch(kind)(actor, batch, max_tokens, attention_weight)


@functools.singledispatch
def _partition(plan: object, *args: Any) -> Partition:
    """The partition of one plan type, looked up by the class (`_partition.dispatch(kind)`): the
    micro-batches are cut before any of their plans exists."""
    raise NotImplementedError(f"no micro-batch partition for a {type(plan).__name__}")


@_partition.register(PromptPlan)
def _(actor: LogProbActor, batch: RolloutBatch, max_tokens: Optional[int], attention_weight: float) -> Partition:
    return partition_micro_batches(GroupedLengths.of(batch, dedup=actor.dedup), max_tokens, attention_weight)


@_partition.register(TriePlan)
def _(actor: LogProbActor, batch: RolloutBatch, max_tokens: Optional[int], attention_weight: float) -> Partition:
    work = TrieLengths.of(batch, actor.config.min_shared_tokens)
    return partition_trie_micro_batches(work, max_tokens, attention_weight)
