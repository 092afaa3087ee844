"""Saved-for-backward bytes with images: the vision path counted as `zorro bench memory` counts text.

One forward of each path over the same MultimodalBatch, every tensor autograd saves counted once
(zorro_harness.bench.memory.count_saved: each storage once, parameters left out), attributed to
the decoder layer, the vision tower, or the rest (embeddings, image placement, lm_head and
log-probs) while it was saved:

- `plain`: BaselineVisionLanguageActor (every row's prompt through the decoder, every image
  occurrence through the tower), packed, on the GPU path's split attention (`flash_cpu`: torch's
  CPU flash kernel saves what flash-attn 2's varlen function saves);
- `zorro`: VisionLanguageActor (each unique prompt once, each distinct image once), same backend;
- `ideal`: the plain path's decoder bytes per token times the tokens zorro computes, its tower
  bytes per image times the distinct images, its other bytes per token times zorro's tokens.
Counted at the model's own size (nothing narrowed or scaled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zorro_harness.bench.memory import count_saved

PATHS = ("plain", "zorro")


@dataclass(frozen=True)
class VisionMemoryRow:
    """The bytes one path saves for backward."""

    path: str
    """plain, zorro or ideal."""
    tokens: int
    """Tokens the decoder computes (the packed row)."""
    images: int
    """Images through the vision tower."""
    decoder_bytes: float
    """Saved inside the decoder layers (all of them)."""
    vision_bytes: float
    """Saved inside the vision tower."""
    other_bytes: float
    """Saved elsewhere: embeddings, image placement, lm_head and log-probs."""

    @property
    def total_bytes(self) -> float:
        return self.decoder_bytes + self.vision_bytes + self.other_bytes


def count_vision_saved(model: Any, mm: Any, backend: str = "flash_cpu") -> list[VisionMemoryRow]:
    """The rows of PATHS and the ideal for `model` (a served vision-language model, train mode) on `mm`."""
    from zorro_core.actor.vision import BaselineVisionLanguageActor, VisionLanguageActor
    from zorro_core.plan.multimodal import distinct_images

    decoder = list(model.model.language_model.layers)
    modules = decoder + [model.model.visual]
    counted = {}
    for path in PATHS:
        cls = BaselineVisionLanguageActor if path == "plain" else VisionLanguageActor
        actor = cls(model=model, varlen_backend=backend)
        tokens: list[int] = []

        def run(actor=actor, tokens=tokens):
            out = actor(mm, calculate_entropy=True)
            tokens.append(out.plan.num_tokens)
            return out

        per_module, outside = count_saved(model, run, modules)
        images = len(distinct_images(mm.images, share=path == "zorro")[0])
        counted[path] = VisionMemoryRow(
            path, tokens[0], images, float(sum(per_module[:-1])), float(per_module[-1]), float(outside)
        )
    plain, zorro = counted["plain"], counted["zorro"]
    per_token = zorro.tokens / plain.tokens
    ideal = VisionMemoryRow(
        "ideal",
        zorro.tokens,
        zorro.images,
        plain.decoder_bytes * per_token,
        plain.vision_bytes * zorro.images / max(plain.images, 1),
        plain.other_bytes * per_token,
    )
    return [plain, zorro, ideal]
