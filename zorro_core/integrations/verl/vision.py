"""verl's multimodal micro-batches read for zorro's vision actor (zorro_core.actor.vision).

What verl 0.9.1 carries (read in its agent loop, `left_right_2_no_padding` and
`FSDPEngineWithLMHead.prepare_model_inputs`): each row's `multi_modal_inputs` is the processor's
dict for that row (`pixel_values` [patches, D], `image_grid_thw` [images, 3], and
`images_seqlens`, a per-frame patch count verl's own code derives from the grid), held in the
micro-batch as a stack of per-row dicts; verl concatenates them over the micro-batch
(`extract_multi_modal_inputs`) and hands them to the model beside the packed row. `position_ids`
are nested [B, 4, len]: row 0 the text positions 0..len-1, rows 1..3 the model's own 3-D mRoPE
positions of the whole [prompt + response] row (its `get_rope_index`, which verl binds to the
processor). zorro gives the vision actor each row's images and exactly those mRoPE positions
(`MultimodalBatch.positions`): rows share a prompt only when their text, their images (by content)
and their prompt positions are the same, each distinct image goes through the vision tower once,
and each response keeps verl's positions.

Served: Qwen2.5-VL and Qwen3-VL (zorro_core.models.vision.VISION_FAMILIES) with images. Falls back to
verl's own forward, naming the reason: videos, any multimodal key but those above, another family,
Ulysses sequence parallelism with images.

verl patches Qwen2.5-VL's attention class (`Qwen2_5_VLAttention.forward`, when it removes padding)
with a function that calls flash-attn itself, past transformers' attention interface that zorro's
hook answers. `serve_own_attention` gives each attention layer of zorro's model a forward that runs
transformers' own one when zorro's route is in its arguments and the class's (verl's) otherwise, so
verl's fallback forward on the same model is unchanged. transformers' own forward is the one the
class held when this module was imported (before verl builds a model: the engine module imports it);
if verl had patched it already, such a model falls back naming that.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch

from zorro_core.models.vision import REFUSED_VISION, VISION_FAMILIES
from zorro_core.plan.multimodal import Image

UNTESTED_HERE = {
    t: f"{t} with images is served by VisionLanguageActor (and TRL's DedupGRPOTrainer) but not tested through verl's engine"
    for t in ("qwen3_5", "qwen3_5_moe")
}
"""Vision families the library serves whose images this integration falls back on, with the reason."""

__all__ = [
    "SERVED_KEYS",
    "has_images",
    "image_rows",
    "image_totals",
    "mrope_of",
    "serve_own_attention",
    "vision_reason",
]

SERVED_KEYS = frozenset({"pixel_values", "image_grid_thw", "images_seqlens"})
"""The keys of a row's multi_modal_inputs zorro serves (`images_seqlens` is verl's, derived from the grid)."""
VIDEO_KEYS = frozenset({"pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "video_second_per_grid"})
"""Video inputs: a video's temporal positions follow its frame times; not served."""


def _own_attention_forwards() -> dict[type, Callable]:
    """transformers' own forward of the attention classes verl patches, as they are now."""
    found: dict[type, Callable] = {}
    try:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLAttention
    except ImportError:  # pragma: no cover - transformers without the family
        return found
    forward = Qwen2_5_VLAttention.forward
    if getattr(forward, "__module__", "").startswith("transformers."):
        found[Qwen2_5_VLAttention] = forward
    return found


_OWN_FORWARD = _own_attention_forwards()
"""transformers' own attention forwards, recorded at import (module doc)."""


def _rows(micro_batch) -> list[Optional[dict]]:
    mm = micro_batch.get("multi_modal_inputs", None)
    if mm is None:
        return [None] * len(micro_batch["input_ids"])
    out = []
    for item in mm:
        item = getattr(item, "data", item)
        out.append(item if isinstance(item, dict) and item else None)
    return out


def has_images(micro_batch) -> bool:
    """Whether any row of the micro-batch carries multimodal inputs."""
    return any(r is not None for r in _rows(micro_batch))


def _patched_attention(model: Any) -> Optional[str]:
    for module in model.modules():
        if any(c.__name__ == "Qwen2_5_VLAttention" and c not in _OWN_FORWARD for c in type(module).__mro__):
            return (
                "verl patched Qwen2.5-VL's attention before zorro's verl engine module was imported "
                "(transformers' own attention forward is unknown)"
            )
    return None


def vision_reason(engine: Any, micro_batch) -> Optional[str]:
    """Why a micro-batch with multimodal inputs is not served (None when it is)."""
    model = engine.module
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in VISION_FAMILIES:
        why = REFUSED_VISION.get(model_type or "", "not a vision-language family zorro serves")
        return f"images with model type {model_type!r}: {why} (served: {', '.join(sorted(VISION_FAMILIES))})"
    if model_type in UNTESTED_HERE:
        return f"images with model type {model_type!r}: {UNTESTED_HERE[model_type]}"
    if engine.use_ulysses_sp:
        return "images under Ulysses sequence parallelism (verl slices a VLM's sequence after its embedding)"
    for i, row in enumerate(_rows(micro_batch)):
        if row is None:
            continue
        keys = {k for k, v in row.items() if v is not None}
        if keys & VIDEO_KEYS:
            return f"video inputs ({', '.join(sorted(keys & VIDEO_KEYS))}): a video's positions follow its frame times"
        if keys - SERVED_KEYS:
            return f"multimodal inputs {sorted(keys - SERVED_KEYS)} (served: {sorted(SERVED_KEYS)})"
        if "pixel_values" not in keys or "image_grid_thw" not in keys:
            return f"row {i}'s multimodal inputs lack pixel_values or image_grid_thw"
    return _patched_attention(model)


def image_totals(micro_batch) -> tuple[int, int]:
    """(images, patches) of the micro-batch's rows, read from their grids."""
    images = patches = 0
    for row in _rows(micro_batch):
        grid = None if row is None else row.get("image_grid_thw")
        if grid is not None:
            grid = torch.as_tensor(grid)
            images += int(grid.shape[0])
            patches += int(grid.prod(-1).sum())
    return images, patches


def image_rows(micro_batch) -> list[tuple[Image, ...]] | str:
    """Each row's images (in prompt order), or why they cannot be read."""
    out: list[tuple[Image, ...]] = []
    for i, row in enumerate(_rows(micro_batch)):
        if row is None:
            out.append(())
            continue
        pv, grid = row["pixel_values"], torch.as_tensor(row["image_grid_thw"])
        if grid.dim() != 2 or grid.shape[1] != 3 or int(grid.prod(-1).sum()) != pv.shape[0]:
            return f"row {i}'s image_grid_thw does not describe its pixel_values"
        sizes = grid.prod(-1).tolist()
        out.append(tuple(Image(p, tuple(g)) for p, g in zip(torch.split(pv, sizes), grid.tolist())))
    return out


def mrope_of(position_ids: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor] | str:
    """verl's nested [B, 4, len] position ids -> each row's [3, len] mRoPE positions, or why not
    (row 0 must be the text positions 0..len-1, as verl writes them)."""
    values = position_ids.values()
    if values.dim() != 2 or values.shape[0] != 4 or values.shape[1] != int(offsets[-1]):
        return f"position ids of shape {tuple(values.shape)} per token (verl's multimodal layout is [4, tokens])"
    lens = offsets.diff()
    row_of = torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens)
    local = torch.arange(values.shape[1], device=lens.device) - offsets[:-1][row_of]
    if not torch.equal(values[0].to(local.dtype), local):
        return "the text row of the position ids is not 0..len-1 per row"
    return list(torch.split(values[1:].long(), lens.tolist(), dim=1))


def serve_own_attention(model: Any) -> None:
    """Give each attention layer whose class forward verl patched a forward that runs transformers'
    own when zorro's route is passed, the class's otherwise (module doc); idempotent."""
    for module in model.modules():
        own = next((f for c, f in _OWN_FORWARD.items() if isinstance(module, c)), None)
        if own is None or getattr(module, "_zorro_own_attention", False):
            continue

        def forward(self, *args: Any, _own: Callable = own, **kwargs: Any) -> Any:
            if "zorro_route" in kwargs:
                return _own(self, *args, **kwargs)
            return type(self).forward(self, *args, **kwargs)

        module.forward = types.MethodType(forward, module)
        module._zorro_own_attention = True
