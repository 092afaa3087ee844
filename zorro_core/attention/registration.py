"""Registering the attention hook once, through transformers' public API.

When an actor takes a model, `install_attention` registers a function in transformers'
AttentionInterface (and the matching mask function in AttentionMaskInterface) under a name
derived from the model's current implementation, and switches the model to it with
`PreTrainedModel.set_attn_implementation`. That function dispatches per call:
- a `zorro_route` in the forward kwargs: zorro's attention (zorro_core.attention.hook);
- none: the model's original implementation (eager, sdpa, flash, flex, ...) unchanged, and
  transformers builds the original's mask, so the model stays usable outside the actor
  (generation included).
Nothing is written per forward. The name carries the original, so a deep copy or a reload of
the model dispatches the same way; "flash" is kept out of the name because transformers
treats any name containing it as a flash kernel to load.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from zorro_core.attention.hook import ZORRO_ATTENTION, original_function, zorro_attention
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.parts import unwrap_adapters

_PREFIX = ZORRO_ATTENTION + "_"
# name registered -> the original implementation it falls back to
_ORIGINALS: dict[str, str] = {}


def attention_name(original: str) -> str:
    """The registered name that falls back to `original` (registering it on first use)."""
    name = _PREFIX + re.sub(r"[^A-Za-z0-9_]", "_", original).replace("flash", "fa")
    if name not in _ORIGINALS:
        _ORIGINALS[name] = original
        AttentionInterface.register(name, _dispatch(original))
        # No mask function when the original has none: transformers then builds no mask for it,
        # which is what it does for the original too.
        if original in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def original_attention(model: nn.Module) -> str:
    """The implementation `model` runs outside the actor (its own, even once zorro is installed)."""
    current = _causal_lm(model).config._attn_implementation or "sdpa"
    if current.startswith(_PREFIX) and current not in _ORIGINALS:
        # Taken in another process (a pickled or deep-copied model): the name says which original; register it here.
        original = current[len(_PREFIX) :].replace("fa_attention", "flash_attention")
        if attention_name(original) != current:
            raise ValueError(f"attention implementation {current!r} looks like zorro's but names no implementation")
        return original
    return _ORIGINALS.get(current, current)


def is_installed(model: nn.Module) -> bool:
    return _causal_lm(model).config._attn_implementation in _ORIGINALS


def install_attention(model: nn.Module) -> str:
    """Route `model`'s attention through zorro's dispatching function (idempotent); returns the original."""
    original = original_attention(model)
    if not is_installed(model):
        _causal_lm(model).set_attn_implementation(attention_name(original))
        if not is_installed(model):  # transformers only warns for a model that does not use the interface
            raise UnsupportedModelError(
                f"{type(_causal_lm(model)).__name__} refused set_attn_implementation: its attention does not go "
                "through transformers' AttentionInterface, so the dedup hook cannot be registered"
            )
    return original


def _dispatch(original: str):
    def attention(
        module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, **kwargs
    ):
        if kwargs.get("zorro_route") is None:
            return original_function(module, original)(module, query, key, value, attention_mask, **kwargs)
        return zorro_attention(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"zorro_or_{original}"
    return attention


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    return unwrap_adapters(model)
