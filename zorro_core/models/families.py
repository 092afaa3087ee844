"""The per-forward glue of the family adapters: installing them, and the router aux loss.

Which family needs which adapter is its entry in zorro_core.models.registry; the adapters:

- `moe`: Qwen3-MoE and Qwen3-Next's MoE blocks: token-wise; the router aux loss, with
  multiplicity weights so that it equals the baseline's.
- `linear_attention`: Qwen3-Next's gated DeltaNet layers: recurrent state and conv window carried
  from each prompt into its responses, chunk partition kept.
- `sliding`: sliding-window attention (Mistral, Qwen2/Qwen3 `use_sliding_window`) needs no
  adapter in the dedup path (the hook applies each layer's window by absolute position); it
  builds the per-layer-type 4D masks of the padded baseline.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from zorro_core.models.moe import AUX_WEIGHTINGS, load_balancing_loss, router_aux_loss, token_multiplicity

__all__ = ["AUX_WEIGHTINGS", "family_hooks", "forward_kwargs", "load_balancing_loss", "router_aux_loss",
           "token_multiplicity", "wants_router_logits"]


@contextlib.contextmanager
def family_hooks(model: nn.Module, parts) -> Iterator[None]:
    """Install the adapters the model's layers need for one deduplicated forward (its registry entry's), then remove them."""
    with contextlib.ExitStack() as stack:
        for adapter in parts.family.adapters:
            stack.enter_context(adapter(model))
        yield


def wants_router_logits(parts, config) -> bool:
    """Whether the forward computes the router aux loss: MoE models with config.output_router_logits,
    transformers' own switch (the router logits of every layer are kept until the loss is built)."""
    return bool(parts.moe and getattr(config, "output_router_logits", False))


def forward_kwargs(parts, config) -> dict[str, Any]:
    """Extra kwargs of the base model's forward."""
    return {"output_router_logits": True} if wants_router_logits(parts, config) else {}


def aux_loss_of(parts, config, outputs, plan, weighting: str) -> Optional[torch.Tensor]:
    """The router aux loss of a packed forward (None unless wants_router_logits)."""
    if not wants_router_logits(parts, config):
        return None
    return router_aux_loss(outputs.router_logits, config, plan, weighting)
