"""Saved-for-backward bytes with images (zorro_harness.bench.vision_memory): zorro's decoder layers and
vision tower save exactly the ideal (the plain path's bytes per token / per image times what zorro
computes), on the GPU path's attention (flash_cpu)."""

import torch

from zorro_core.models.vision import build_vision_model, tiny_config
from zorro_harness.bench.vision_memory import count_vision_saved


def test_the_vision_path_saves_the_ideal_bytes():
    from tests.models.test_vlm import vision_batch

    model = build_vision_model(tiny_config("qwen2_5_vl"), dtype=torch.float32)
    model.train()
    mm = vision_batch()
    plain, zorro, ideal = count_vision_saved(model, mm)
    assert (plain.images, zorro.images) == (8, 3)  # every image occurrence vs the distinct a, b, c
    assert zorro.tokens < plain.tokens
    # Per token and per image, zorro saves what the plain path saves: the ideal, to within rounding.
    assert abs(zorro.decoder_bytes - ideal.decoder_bytes) <= 1e-9 * ideal.decoder_bytes + 64 * 2
    assert zorro.vision_bytes < plain.vision_bytes and zorro.decoder_bytes < plain.decoder_bytes
    assert zorro.total_bytes < plain.total_bytes
