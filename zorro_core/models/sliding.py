"""Sliding-window attention (Mistral; Qwen2/Qwen3 with use_sliding_window).

The dedup path needs no adapter: each layer hands the attention hook its `sliding_window`, and
the hook applies transformers' rule, query q sees key k iff q - window < k <= q, by absolute
position in both split calls and in mask mode. What does need care is a caller that builds its
own 4D mask (the padded baseline): transformers uses a custom 4D mask as given, so the window
must already be in it, per layer type.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

MaskBuilder = Callable[[Optional[int]], torch.Tensor]


def sliding_window_of(config) -> Optional[int]:
    """The window of the model's sliding layers, or None when no layer slides."""
    return getattr(config, "sliding_window", None) or None


def custom_masks(config, build: MaskBuilder) -> Union[torch.Tensor, dict[str, torch.Tensor]]:
    """The attention_mask argument for a model given 4D masks made by `build(window)`.

    Models with `layer_types` (Qwen2, Qwen3) take one mask per layer type; models without them
    (Mistral) use one mask for every layer, all of which slide when `sliding_window` is set.
    """
    window = sliding_window_of(config)
    if window is None:
        return build(None)
    types = getattr(config, "layer_types", None)
    if not types:
        return build(window)
    return {t: build(window if t == "sliding_attention" else None) for t in dict.fromkeys(types)}
