"""TRL's gradient-accumulation window as one prompt-once step (`ActorConfig(schedule="prompt_once")`).

TRL's `_prepare_inputs` generates one batch every `steps_per_generation` micro-steps, shuffles it
and cuts it into that many slices; `Trainer` then calls `training_step` once per slice and steps
the optimizer after `gradient_accumulation_steps` of them (the window). A group of
`num_generations` rows is spread over the window's slices, so within-micro-batch dedup computes
its prompt once per slice that holds a row. Here the first `compute_loss` of a window computes
the whole window (all its slices are buffered by then) as one step of
zorro_core.actor.schedule.prompt_once_step:

1. each unique prompt of the window forward once;
2. each slice's live rows (a completion token at least) as one response micro-batch, in the
   slices' order: its loss is TRL's own `compute_loss` on that slice, fed zorro's log-probs and
   entropies (`_get_per_token_logps_and_entropies` returns them for that call), so every loss
   type, the KL term, entropy masking, the entropy bonus, its normalisation and its metrics are
   TRL's; the backward is of that loss scaled as `accelerator.backward` scales it;
3. the prompts' backward once.

The loss `training_step` returns for each slice is the stored one: the window's later calls
are served from it (a leaf that takes `accelerator.backward` without touching a parameter).
Gradient synchronisation happens once, inside the first call and after the prompts' backward,
and equals the wrapper's own: FSDP2's gradient sync is off through phase 2 and on for phase 3
(as verl's engine does); DDP runs the step under `no_sync` and then averages the gradients
over the ranks once (one all-reduce of the flattened gradients, each divided by the world size
first, as DDP's reducer does). TRL's own metric collectives (entropy-mask quantile, logged means)
run once per slice in the same order on every rank, as in TRL. The entropy bonus's adaptive
controller reads `accelerator.sync_gradients`: it is True for the window's last slice only, as
in TRL's own loop.

Handed back to the per-slice path (the window's calls are then TRL's usual ones through
zorro's within-micro-batch dedup; a one-time `DedupFallbackWarning` says why) where: the window's
slices are not all buffered at its first call (`steps_per_generation` not a multiple of the
window), the MoE aux loss, vision inputs, DeepSpeed, a slice whose completions are all masked,
whatever the per-slice path refuses (layout, `cast_lm_head_to_fp32`, tensor/context
parallelism, ...), and what the schedule refuses. The ranks agree first, so all take one path.
A window of one slice is not a hand-back: the per-slice path computes each prompt once there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from zorro_core.actor.schedule import ScheduleOutput, prompt_once_step, schedule_refusal
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.vision_layout import VISION_KEYS
from zorro_core.plan.batch import RolloutBatch

HANDED_BACK = "the per-slice path (each prompt once per slice) serves this window"
"""What the one-time warning says runs where the window is not served."""


@dataclass
class Window:
    """One gradient-accumulation window in progress: its calls and, when served, their losses."""

    size: int
    """The window's `compute_loss` calls (Trainer's `current_gradient_accumulation_steps`)."""
    slices: list[dict[str, Any]]
    """The buffered slices, in the order `compute_loss` gets them (empty where they were not at hand)."""
    losses: Optional[list[torch.Tensor]]
    """Each slice's loss as TRL's `compute_loss` returned it (detached); None: handed back."""
    next: int = 0
    """The call the next `compute_loss` is."""


def window_slices(trainer: Any) -> tuple[list[dict[str, Any]], Optional[str]]:
    """The slices of the window starting now (its first slice is the current `_step`'s), or why
    they are not all at hand."""
    spg = trainer.args.steps_per_generation
    n = trainer.current_gradient_accumulation_steps
    first = trainer._step % spg
    buffered = trainer._buffered_inputs
    if buffered is None or first + n > spg or len(buffered) != spg:
        return [], (
            f"the window's {n} slices are not all generated at its first step (steps_per_generation "
            f"{spg} is not a multiple of gradient_accumulation_steps)"
        )
    return list(buffered[first : first + n]), None


def local_refusal(trainer: Any, model: Any, slices: list[dict[str, Any]]) -> Optional[str]:
    """Why this rank cannot serve the window (None: it can), judged before any collective."""
    if trainer.aux_loss_enabled:
        return "the MoE router aux loss is not served by the window (TRL counts it per slice)"
    used = sorted({k for s in slices for k in VISION_KEYS + ("token_type_ids",) if s.get(k) is not None})
    if used:
        return f"vision inputs ({', '.join(used)}) are not served by the window"
    widths = {(s["prompt_ids"].shape[1], s["completion_ids"].shape[1]) for s in slices}
    if len(widths) != 1:
        return "the window's slices have different widths"
    ids, mask, keep = joined(slices)
    reason = trainer._refusal(model, mask, keep, False, {})
    if reason is not None:
        return reason
    if any(not bool(s["completion_mask"].bool().any()) for s in slices):
        return "a slice of the window has every completion masked"
    reason, wrapped, actor = trainer._served(model, False)
    if reason is not None:
        return reason
    if wrapped.kind in ("deepspeed", "zero3"):
        return "DeepSpeed is not served by the window (its engine owns the backward and the accumulation boundary)"
    return schedule_refusal(actor)


def joined(slices: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The window's rows as TRL's joined [prompt | completion] ids and attention mask, and the completion width."""
    ids = torch.cat([torch.cat([s["prompt_ids"], s["completion_ids"]], 1) for s in slices])
    mask = torch.cat([torch.cat([s["prompt_mask"], s["completion_mask"]], 1) for s in slices])
    return ids, mask, slices[0]["completion_ids"].shape[1]


def run_window(
    trainer: Any,
    model: Any,
    slices: list[dict[str, Any]],
    loss_of_slice: Callable[[int, torch.Tensor, Optional[torch.Tensor]], torch.Tensor],
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The window as one prompt-once step (module doc): each slice's loss (detached) and a record.

    `loss_of_slice(j, log_probs, entropy)` is the slice's TRL loss on those [b_j, C] tensors."""
    _, wrapped, actor = trainer._served(model, False)
    ids, mask, keep = joined(slices)
    p = ids.shape[1] - keep
    mask = mask.long()
    live = mask[:, p:].bool().any(1)
    sizes = [s["completion_ids"].shape[0] for s in slices]
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    # Each slice's live rows, renumbered in the schedule's batch (live rows only, slices in order).
    rows = live.nonzero().flatten()
    position = torch.full((ids.shape[0],), -1, dtype=torch.long)
    position[rows.cpu()] = torch.arange(rows.numel())
    parts = [position[s : s + n][live[s : s + n].cpu()].tolist() for s, n in zip(starts, sizes)]
    batch = RolloutBatch(ids[rows, :p], mask[rows, :p], ids[rows, p:], mask[rows, p:])
    losses: list[torch.Tensor] = []
    scale = trainer.accelerator.gradient_accumulation_steps
    scaler = trainer.accelerator.scaler

    def loss_fn(out, idx):
        j = len(losses)
        s, n = starts[j], sizes[j]
        local = live[s : s + n].nonzero().flatten()

        def place(values):
            return values.new_zeros((n, keep)).index_put((local,), values)

        loss = loss_of_slice(j, place(out.log_probs), place(out.entropy) if out.entropy is not None else None)
        losses.append(loss.detach())
        loss = loss / scale  # as accelerator.backward scales it (Trainer's training_step passes it there)
        return scaler.scale(loss) if scaler is not None else loss

    start = time.perf_counter()
    with trainer.accelerator.autocast():
        try:
            res = _synced_step(wrapped, actor, batch, loss_fn, parts, trainer.temperature)
        except UnsupportedModelError as e:
            if losses:  # a slice's backward ran: the window cannot be handed back any more
                raise RuntimeError(f"the prompt-once schedule failed after a slice's backward: {e}") from e
            raise
    record = {
        "model": "policy",
        "wrapper": wrapped.kind,
        "grad": True,
        "window": len(slices),
        "rows": int(rows.numel()),
        "aux": False,
        "regrouped": False,
        "schedule": "prompt_once",
        "prompts": res.prompt_nodes,
        "prompt_tokens": res.prompt_tokens,
        "response_tokens": sum(res.response_tokens),
        "split_groups": len(res.split_groups),
        "kept_bytes": res.kept_bytes,
        "fallback": res.fallback,
        "seconds": time.perf_counter() - start,
    }
    return losses, record


def _synced_step(wrapped, actor, batch, loss_fn, parts, temperature) -> ScheduleOutput:
    """prompt_once_step with the wrapper's gradient sync once, after the prompts' backward (module doc)."""

    def step(on_prompts_backward=None) -> ScheduleOutput:
        return prompt_once_step(
            actor, batch, loss_fn, None, temperature, True, parts, on_prompts_backward=on_prompts_backward
        )

    if wrapped.kind == "fsdp2":
        module = wrapped.outer
        assert isinstance(module, FSDPModule)
        module.set_requires_gradient_sync(False)
        try:
            return step(lambda: module.set_requires_gradient_sync(True))
        finally:
            module.set_requires_gradient_sync(True)
    if wrapped.kind == "ddp":
        with wrapped.outer.no_sync():
            res = step()
        average_gradients(wrapped.inner, getattr(wrapped.outer, "process_group", None))
        return res
    return step()


def average_gradients(module: torch.nn.Module, group: Optional[Any] = None, bucket_mib: int = 25) -> None:
    """DDP's reduction of the accumulated gradients, once: each divided by the world size, then
    summed over the ranks of `group` (DDP's process group; None: the default one), in flat buckets
    of about `bucket_mib` MiB per dtype as DDP's reducer does, so the copy it takes stays small
    beside the gradients. A trainable parameter without a gradient gets zeros first, so that every
    rank's buckets have the same layout."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    limit = bucket_mib * 2**20
    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        assert grad is not None  # zero-filled above
        bucket = buckets.setdefault(grad.dtype, [])
        bucket.append(grad)
        if sum(g.numel() for g in bucket) * grad.element_size() >= limit:
            _all_reduce_mean(bucket, world, group)
            bucket.clear()
    for bucket in buckets.values():
        if bucket:
            _all_reduce_mean(bucket, world, group)


def _all_reduce_mean(grads: list[torch.Tensor], world: int, group: Optional[Any]) -> None:
    """One all-reduce of `grads` (one dtype) flattened, each divided by `world` first; written back in place."""
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(world)
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
