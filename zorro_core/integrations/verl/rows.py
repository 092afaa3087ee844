"""verl's micro-batch read as zorro's rows: the prompt/response split, what zorro cannot serve, the
temperature and the Ulysses group. Shared by the engine (zorro_core.integrations.verl.engine) and its
micro-batching and metrics modules, which the engine imports.
"""

from __future__ import annotations

from typing import Optional

import torch
from verl.utils import tensordict_utils as tu

from zorro_core.actor.vision import ImageCounts
from zorro_core.distributed.ulysses import SequenceParallel
from zorro_core.integrations.verl.vision import has_images, image_rows, mrope_of, vision_reason
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.multimodal import MultimodalBatch

__all__ = [
    "REFUSED",
    "VerlRows",
    "flag",
    "prompt_lengths",
    "prompt_tokens",
    "rows_of",
    "sequence_parallel_of",
    "temperature_of",
    "unserved_reason",
]

REFUSED = "the dedup path refuses the model"
"""How the reason of a micro-batch whose model the actor refused starts (the batching reads it)."""


class VerlRows:
    """A micro-batch's rows split into prompt and response (on the micro-batch's device)."""

    def __init__(
        self,
        batch: RolloutBatch,
        live: torch.Tensor,
        offsets,
        prompt_lens,
        response_lens,
        images: Optional[MultimodalBatch] = None,
    ):
        self.batch = batch
        """The live rows (a response of >= 1 token) in zorro's layout."""
        self.live = live
        """Their indices in the micro-batch."""
        self.offsets, self.prompt_lens, self.response_lens = offsets, prompt_lens, response_lens
        self.images = images
        """The live rows with their images and verl's mRoPE positions (a multimodal micro-batch), else None."""
        self.image_counts: Optional[ImageCounts] = None
        """What the vision actor encoded of them (set by `forward`)."""
        self.plan = None
        """The plan of the vision actor's call (set by `forward` with images)."""

    def forward(self, actor, **kwargs):
        """The actor on these rows: with their images and positions when the micro-batch has them."""
        if self.images is None:
            return actor.forward(self.batch, **kwargs)
        out = actor.forward(self.images, **kwargs)
        self.image_counts, self.plan = actor.last_images, out.plan
        return out

    def to_nested(self, values: torch.Tensor) -> torch.Tensor:
        """[live, R] per-response-token values -> verl's nested layout over every row's tokens (0 elsewhere)."""
        r = values.shape[1]
        k = torch.arange(r, device=values.device)
        starts = (self.offsets[:-1] + self.prompt_lens - 1)[self.live]
        lens = self.response_lens[self.live]
        keep = k[None] < lens[:, None]
        positions = (starts[:, None] + k[None])[keep]
        flat = values.new_zeros(int(self.offsets[-1])).index_put((positions,), values[keep])
        return torch.nested.nested_tensor_from_jagged(flat, self.offsets)


def prompt_lengths(micro_batch) -> Optional[torch.Tensor]:
    prompts = micro_batch.get("prompts", None)
    if prompts is None:
        return None
    if prompts.is_nested:
        return prompts.offsets().diff()
    mask = micro_batch.get("attention_mask", None)
    if mask is None or mask.is_nested:
        return None
    return mask[:, : prompts.shape[1]].sum(1)


def prompt_tokens(data) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Every row's prompt as (tokens [B, P], mask [B, P]) for `prompt_groups`: verl's `prompts`,
    nested (its rows, padded here) or padded (with `attention_mask`'s prompt columns). None when
    the rows have no prompt/response split."""
    prompts = data.get("prompts", None)
    if prompts is None:
        return None
    if not prompts.is_nested:
        mask = data.get("attention_mask", None)
        if mask is None or mask.is_nested:
            return None
        return prompts, mask[:, : prompts.shape[1]]
    offsets = prompts.offsets()
    lens = offsets.diff()
    values = prompts.values()
    width = int(lens.max()) if lens.numel() else 0
    row = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    column = torch.arange(values.numel(), device=lens.device) - offsets[:-1][row]
    padded = values.new_zeros((len(lens), width)).index_put((row, column), values)
    mask = (torch.arange(width, device=lens.device)[None] < lens[:, None]).long()
    return padded, mask


def rows_of(micro_batch) -> VerlRows | str:
    """The rows of verl's micro-batch for the deduplicated actor, or why they cannot be served."""
    input_ids = micro_batch["input_ids"]
    if not input_ids.is_nested:
        return "input_ids is not a nested (no-padding) tensor"
    offsets = input_ids.offsets()
    lens = offsets.diff()
    values = input_ids.values()
    plen = prompt_lengths(micro_batch)
    if plen is None:
        return "the micro-batch has no prompt/response split (no `prompts` field: SFT data)"
    plen = plen.to(lens.device, torch.long)
    rlen = lens - plen
    if bool((plen < 1).any()) or bool((rlen < 0).any()):
        return "a row's prompt is empty or longer than the row"
    position_ids = micro_batch["position_ids"]
    row_of = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    local = torch.arange(values.numel(), device=lens.device) - offsets[:-1][row_of]
    mrope: Optional[list[torch.Tensor]] = None
    if position_ids.dim() != 2:
        # verl's multimodal layout [B, 4, len]: served through the vision actor with these positions.
        found = mrope_of(position_ids, offsets)
        if isinstance(found, str):
            return found
        mrope = found
    elif not torch.equal(position_ids.values().to(local.dtype), local):
        return "position ids are not 0..len-1 per row (the dedup path numbers each sequence from 0)"
    if mrope is None and has_images(micro_batch):
        return "multi-modal inputs with 1-D position ids (verl gives a vision model's rows 3-D mRoPE positions)"
    prompts = micro_batch["prompts"]
    live = (rlen > 0).nonzero().flatten()
    if live.numel() == 0:
        return "every response in the micro-batch is empty"
    p, r = int(plen.max()), int(rlen[live].max())
    starts = offsets[:-1][live]
    pl, rl = plen[live], rlen[live]
    j = torch.arange(p, device=lens.device)
    p_valid = j[None] >= (p - pl)[:, None]
    p_idx = (starts[:, None] + pl[:, None] - p + j[None]).clamp(0, values.numel() - 1)
    prompt_ids = torch.where(p_valid, values[p_idx], 0)
    k = torch.arange(r, device=lens.device)
    r_valid = k[None] < rl[:, None]
    r_idx = (starts[:, None] + pl[:, None] + k[None]).clamp(0, values.numel() - 1)
    response_ids = torch.where(r_valid, values[r_idx], 0)
    # The split must be the one verl's loss reads: the prompt tokens are `prompts`' real tokens.
    if prompts.is_nested:
        given = prompts.values()
        mine = values[(offsets[:-1][row_of] + local)[local < plen[row_of]]]
    else:
        width = prompts.shape[1]
        pmask = micro_batch["attention_mask"][:, :width].bool()
        given, mine = prompts[pmask], values[local < plen[row_of]]
    if not torch.equal(given.to(mine.dtype), mine):
        return "the prompt tokens in input_ids differ from `prompts`: not verl's layout"
    batch = RolloutBatch.of_validated(prompt_ids, p_valid.long(), response_ids, r_valid.long())
    images = None
    if mrope is not None:
        every = image_rows(micro_batch)
        if isinstance(every, str):
            return every
        keep = live.tolist()
        images = MultimodalBatch(batch, tuple(every[i] for i in keep), tuple(mrope[i] for i in keep))
    return VerlRows(batch, live, offsets, plen, rlen, images)


def flag(micro_batch, key: str) -> bool:
    return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=False))


def unserved_reason(engine, micro_batch) -> Optional[str]:
    """Why verl's own forward must serve this micro-batch (None when zorro serves it)."""
    if engine.use_ulysses_sp and engine.ulysses_parallel_group is None:
        return "Ulysses sequence parallelism without the engine's SP process group"
    if flag(micro_batch, "use_fused_kernels") or engine.model_config.use_fused_kernels:
        return "use_fused_kernels"
    if flag(micro_batch, "calculate_sum_pi_squared"):
        return "calculate_sum_pi_squared (an output the dedup path does not compute)"
    if flag(micro_batch, "distillation_use_topk") or flag(micro_batch, "distillation_only"):
        return "top-k distillation (teacher tensors over every token)"
    if "routed_experts" in micro_batch.keys():
        return "routed-experts replay"
    if has_images(micro_batch) or micro_batch["position_ids"].dim() != 2:
        reason = vision_reason(engine, micro_batch)
        if reason is not None:
            return reason
    from verl.utils.fsdp_utils import fsdp_version

    if fsdp_version(engine.module) == 1:
        return "an FSDP1 module (strategy=fsdp): its root forward gathers the parameters; use strategy=fsdp2"
    return None


def sequence_parallel_of(engine) -> Optional[SequenceParallel]:
    """The engine's Ulysses group (None without SP). Every rank of it holds the same micro-batch (verl
    dispatches data by data-parallel rank); the gather's backward scales by the SP size, as verl's
    `gather_outputs_and_unpad` does, so FSDP's average over dp x sp ranks gives verl's gradients."""
    if not engine.use_ulysses_sp:
        return None
    return SequenceParallel.of(engine.ulysses_parallel_group)


def temperature_of(micro_batch) -> float | str:
    t = micro_batch["temperature"]
    if isinstance(t, torch.Tensor):
        flat = t.flatten()
        if flat.numel() == 0:
            return "an empty temperature tensor"
        if not bool((flat == flat[0]).all()):
            return "per-row temperatures that differ"
        t = flat[0]
    # verl scales logits by the temperature as a float32 tensor cast to the logits' dtype.
    return float(torch.as_tensor(float(t), dtype=torch.float32))
