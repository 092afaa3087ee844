"""Trainers' vision inputs in the joined layout: which are served, and their log-probs through the vision actor.

Trainers hand a call's images as a processor does: every image's patches concatenated
(`pixel_values` [sum patches, D]), one grid per image (`image_grid_thw` [n, 3]) and the number of
images of each row (`num_images`). `vision_refusal` says why such a call is not served (None when
it is); `joined_vision_logprobs` is `joined_logprobs` with each row's images
(zorro_core.actor.vision).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from zorro_core.integrations.layout import joined_calls
from zorro_core.models.vision import VISION_FAMILIES, token_types
from zorro_core.plan.multimodal import Image, MultimodalBatch

VISION_KEYS = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids")
"""The vision inputs served (Qwen2.5-VL / Qwen3-VL images); any other vision input falls back."""


def vision_refusal(config: Any, input_ids: torch.Tensor, inputs: dict[str, Any]) -> Optional[str]:
    """Why a call with vision inputs `inputs` (VISION_KEYS) is not served, or None."""
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_FAMILIES:
        return f"images with a {model_type} model are not served by the dedup path (served: {sorted(VISION_FAMILIES)})"
    pv, grid, num = inputs.get("pixel_values"), inputs.get("image_grid_thw"), inputs.get("num_images")
    if pv is None or grid is None or num is None:
        return "vision inputs without pixel_values, image_grid_thw and num_images together are not served"
    if len(num) != input_ids.shape[0] or sum(num) != grid.shape[0] or int(grid.prod(-1).sum()) != pv.shape[0]:
        return "num_images, image_grid_thw and pixel_values do not describe the same images"
    types = inputs.get("mm_token_type_ids")
    if types is None:
        # Without them the model's own forward numbers the image tokens as text (1-D positions).
        return "images without mm_token_type_ids are not served (the model would give its image tokens text positions)"
    if not torch.equal(types.to(input_ids.device).long(), token_types(input_ids, config)):
        return "mm_token_type_ids differ from the image placeholders of input_ids"
    return None


def row_images(
    pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, num_images: Sequence[int]
) -> list[tuple[Image, ...]]:
    """Each row's images, in order, from the processor layout."""
    sizes = image_grid_thw.prod(-1).tolist()
    images = [Image(pv, tuple(g)) for pv, g in zip(torch.split(pixel_values, sizes), image_grid_thw.tolist())]
    rows, at = [], 0
    for n in num_images:
        rows.append(tuple(images[at : at + int(n)]))
        at += int(n)
    return rows


def joined_vision_logprobs(
    actor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    images: Sequence[tuple[Image, ...]],
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    rows_per_call: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`joined_logprobs` (zorro_core.integrations.layout) with `images[i]` the images of row i:
    [B, R] log-probs (and entropy), 0 on rows whose response is all padding."""
    return joined_calls(
        lambda rows, batch: actor.forward(
            MultimodalBatch(batch, tuple(images[i] for i in rows.tolist())),
            temperature=temperature,
            calculate_entropy=calculate_entropy,
        ),
        input_ids,
        attention_mask,
        response_width,
        calculate_entropy,
        rows_per_call,
    )
