"""Gradient (activation) checkpointing, switched through transformers' own API.

The actors need nothing from it: transformers wraps each decoder layer's forward in
torch.utils.checkpoint and re-passes the layer's kwargs in the recompute, so the zorro route
(and with it the dedup plan) reaches the recomputed attention and adapters unchanged. This
module only gives the harness (verify, bench) one way to switch it on and off, under either
name transformers uses (`activation_checkpointing_enable` from 5.x; `gradient_checkpointing_enable`
before, deprecated since).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from torch import nn

from zorro_core.models.parts import unwrap_adapters

CHECKPOINTING = ("non-reentrant", "reentrant")
"""The flavours: torch.utils.checkpoint with use_reentrant=False (transformers' default) or True."""


def enable_checkpointing(model: nn.Module, flavour: str = "non-reentrant") -> None:
    """Checkpoint every decoder layer of `model` (a causal LM or a peft model around one)."""
    if flavour not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {flavour!r}; choose one of {CHECKPOINTING}")
    lm = unwrap_adapters(model)
    kwargs = {"use_reentrant": flavour == "reentrant"}
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model: nn.Module) -> None:
    lm = unwrap_adapters(model)
    (getattr(lm, "activation_checkpointing_disable", None) or lm.gradient_checkpointing_disable)()


@contextlib.contextmanager
def checkpointed(model: nn.Module, flavour: Optional[str]) -> Iterator[nn.Module]:
    """`model` in training mode with checkpointing (None: untouched), then as it was."""
    if flavour is None:
        yield model
        return
    was_training = model.training
    enable_checkpointing(model, flavour)
    model.train()
    try:
        yield model
    finally:
        disable_checkpointing(model)
        model.train(was_training)
