"""OpenRLHF's vision-language calls read for zorro's vision actor (zorro_core.actor.vision).

What OpenRLHF 0.11.2 passes (read in its `Actor.forward`, `merge_mm_train_inputs` and
`PolicyModelActor`): a vision-language model (`Actor.is_vlm`) is called padded (OpenRLHF refuses
`--packing_samples` for VLMs) with `**mm_inputs`, every sample's processor outputs concatenated in
row order (`pixel_values` [patches, D], `image_grid_thw` [images, 3], and the processor's
`mm_token_type_ids` of the prompt, which `Actor.forward` replaces with one built from the whole
sequence). Its model numbers its own 3-D positions (`position_ids=None`). zorro reads each row's
images off the grids in order, as many as its image placeholders need, and the vision actor
computes each unique prompt (text and images) once with the model's own positions.

Served: Qwen2.5-VL and Qwen3-VL with images. Handed back to OpenRLHF's forward, naming the reason:
videos, any other multimodal key, another family, images that do not match the placeholders.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from zorro_core.models.vision import REFUSED_VISION, VISION_FAMILIES, image_tokens
from zorro_core.plan.multimodal import Image

UNTESTED_HERE = {
    t: f"{t} with images is served by VisionLanguageActor (and TRL's DedupGRPOTrainer) but not tested through OpenRLHF's actor"
    for t in ("qwen3_5", "qwen3_5_moe")
}
"""Vision families the library serves whose images this integration falls back on, with the reason."""

__all__ = ["SERVED_KEYS", "row_images", "vision_reason"]

SERVED_KEYS = frozenset({"pixel_values", "image_grid_thw", "mm_token_type_ids"})
"""The mm_inputs served (`mm_token_type_ids` is rebuilt by OpenRLHF from the sequence, and by zorro)."""


def vision_reason(config: Any, mm_inputs: dict) -> Optional[str]:
    """Why a call with `mm_inputs` is not served (None when it is)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_FAMILIES:
        why = REFUSED_VISION.get(model_type or "", "not a vision-language family zorro serves")
        return f"images with model type {model_type!r}: {why} (served: {', '.join(sorted(VISION_FAMILIES))})"
    if model_type in UNTESTED_HERE:
        return f"images with model type {model_type!r}: {UNTESTED_HERE[model_type]}"
    keys = {k for k, v in mm_inputs.items() if v is not None}
    if any("video" in k for k in keys):
        return f"video inputs ({', '.join(sorted(k for k in keys if 'video' in k))}): a video's positions follow its frame times"
    if keys - SERVED_KEYS:
        return f"multimodal inputs {sorted(keys - SERVED_KEYS)} (served: {sorted(SERVED_KEYS)})"
    if "pixel_values" not in keys or "image_grid_thw" not in keys:
        return "multimodal inputs without pixel_values and image_grid_thw"
    return None


def row_images(
    sequences: torch.Tensor, attention_mask: torch.Tensor, mm_inputs: dict, config: Any
) -> list[tuple[Image, ...]] | str:
    """Each row's images in order (the next ones of the concatenated grids, as many as its image
    placeholders hold), or why they do not match."""
    pv, grid = mm_inputs["pixel_values"], torch.as_tensor(mm_inputs["image_grid_thw"])
    if grid.dim() != 2 or grid.shape[1] != 3 or int(grid.prod(-1).sum()) != pv.shape[0]:
        return "image_grid_thw does not describe pixel_values"
    images = [Image(p, tuple(g)) for p, g in zip(torch.split(pv, grid.prod(-1).tolist()), grid.tolist())]
    merge = config.vision_config.spatial_merge_size
    placeholders = ((sequences == config.image_token_id) & attention_mask.bool()).sum(1).tolist()
    rows, at = [], 0
    for i, need in enumerate(placeholders):
        mine: list[Image] = []
        while need > 0 and at < len(images):
            need -= image_tokens(images[at], merge)
            mine.append(images[at])
            at += 1
        if need != 0:
            return f"row {i}'s image placeholders do not match the image tokens of its images"
        rows.append(tuple(mine))
    if at != len(images):
        return f"{len(images) - at} image(s) beyond the rows' placeholders"
    return rows
