"""Model families beyond dense softmax attention: what each needs from the deduplicated forward.

- `moe`: Qwen3-MoE and Qwen3-Next's MoE blocks: token-wise; the router aux loss, with
  multiplicity weights so that it equals the baseline's.
- `linear_attention`: Qwen3-Next's gated DeltaNet layers: recurrent state and conv window carried
  from each prompt into its responses, chunk partition kept.
- `sliding`: sliding-window attention (Mistral, Qwen2/Qwen3 `use_sliding_window`) needs no
  adapter in the dedup path (the hook applies each layer's window by absolute position); it
  builds the per-layer-type 4D masks of the padded baseline.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zorro_core.models.linear_attention import fla_available, install_linear_attention
from zorro_core.models.moe import AUX_WEIGHTINGS, load_balancing_loss, router_aux_loss, token_multiplicity

__all__ = ["AUX_WEIGHTINGS", "install_family_adapters", "family_support", "forward_kwargs", "load_balancing_loss", "router_aux_loss",
           "token_multiplicity", "wants_router_logits"]


def install_family_adapters(model: nn.Module, parts) -> None:
    """Install the adapters the model's layers need (idempotent); they act only on calls that carry a route."""
    if parts.num_linear_layers:
        install_linear_attention(model)


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


def family_support(device: str | torch.device = "cpu") -> dict[str, str]:
    """Each model type the dedup path serves, and how it runs on `device` (for `zorro env`)."""
    device = torch.device(device)
    if device.type == "cuda" and fla_available() is None:
        linear = "flash-linear-attention varlen kernel"
    else:
        linear = "PyTorch fallback over a padded batch, slow (" + ("fla needs CUDA" if fla_available() is None else "fla not installed") + ")"
    return {
        "llama": "ok",
        "qwen2": "ok (sliding window by absolute position)",
        "qwen3": "ok (sliding window by absolute position)",
        "mistral": "ok (sliding window by absolute position)",
        "qwen3_moe": "ok (router aux loss: multiplicity weights by default)",
        "qwen3_next": f"ok (gated DeltaNet: {linear}; MoE aux loss as qwen3_moe)",
    }
