"""The glue of the family adapters: installing them when an actor takes a model, and the router aux loss.

Which family needs which adapter is its entry in zorro_core.models.registry; the adapters:

- `moe`: the MoE blocks of Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE (shared experts included):
  token-wise; the router aux loss, with multiplicity weights so that it equals the baseline's.
- `linear_attention`: the gated DeltaNet layers of Qwen3-Next and Qwen3.5: recurrent state and conv
  window carried from each prompt into its responses, chunk partition kept. (Qwen3.5's mRoPE gets
  the packed row's 2-D text positions, which it gives all three of its sections: the 1-D rope.)
- sliding-window attention (Mistral, Qwen2/Qwen3 `use_sliding_window`, Gemma 3 and OLMo 3 with
  sliding and full layers by `layer_types`) needs no adapter: each layer hands the hook its
  `sliding_window` (None on full layers), which the hook applies by absolute position (and the
  padded baseline's route builds its mask per window); a rope per layer type is computed by the
  model from zorro's position ids.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from zorro_core.models.moe import AUX_WEIGHTINGS, load_balancing_loss, router_aux_loss

__all__ = [
    "AUX_WEIGHTINGS",
    "RouterAuxLossWarning",
    "install_family_adapters",
    "forward_kwargs",
    "load_balancing_loss",
    "router_aux_loss",
    "wants_router_logits",
]


def install_family_adapters(model: nn.Module, parts) -> None:
    """Install the adapters the model's layers need (its registry entry's), once; they act only on calls that carry a route."""
    for adapter in parts.family.adapters:
        adapter(model)


def check_router_aux_loss(requested: object) -> None:
    """TypeError unless a call's `router_aux_loss` is None, True or False (a string "no" is no switch)."""
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(f"router_aux_loss must be True, False or None, got {type(requested).__name__} {requested!r}")


def wants_router_logits(parts, config, requested: Optional[bool] = None) -> bool:
    """Whether the forward computes the router aux loss: MoE models whose call asks for it
    (`requested`), or, when the call does not say, whose config.output_router_logits is set
    (transformers' switch: the router logits of every layer are kept until the loss is built; a
    vision-language composite's is its text config's, as its own forward reads it)."""
    config = _text_config(config)
    on = getattr(config, "output_router_logits", False) if requested is None else requested
    return bool(parts.moe and on)


def forward_kwargs(parts, config, requested: Optional[bool] = None) -> dict[str, Any]:
    """Extra kwargs of the base model's forward: the call's router-logits switch, passed as the
    forward kwarg transformers' MoE models take, so that a call never writes the shared config."""
    if wants_router_logits(parts, config, requested):
        return {"output_router_logits": True}
    if parts.moe and getattr(_text_config(config), "output_router_logits", False):
        return {"output_router_logits": False}  # the config would keep them; this call asks for none
    return {}


class RouterAuxLossWarning(UserWarning):
    """The MoE router aux loss is computed but its gradient cannot reach the routers (reentrant checkpointing)."""


def warn_aux_gradient_lost(owner: Any, hidden: torch.Tensor, router_logits: Any) -> None:
    """Once per `owner` (an actor), warn when the forward's output takes gradients but some router logits do
    not: reentrant checkpointing runs the layers under no_grad in the forward, so the aux loss built from
    them gives the routers no gradient (transformers' own aux loss loses it alike: zorro equals the plain
    computation, and both train the routers without the loss)."""
    if owner.__dict__.get("_aux_gradient_warned") or not hidden.requires_grad:
        return
    if all(r.requires_grad for r in router_logits):
        return
    owner._aux_gradient_warned = True
    warnings.warn(
        "zorro: the MoE router aux loss under reentrant gradient checkpointing gets no gradient (the layers run "
        "under no_grad in the forward, so the router logits it is built from carry none; transformers' own "
        "forward loses it alike): the routers train without the aux loss. Use non-reentrant checkpointing "
        "(use_reentrant=False, transformers' default) or router_aux_loss=False.",
        RouterAuxLossWarning,
        stacklevel=4,
    )


def aux_loss_of(
    parts, config, outputs, plan, weighting: str, requested: Optional[bool] = None, owner: Any = None
) -> Optional[torch.Tensor]:
    """The router aux loss of a packed forward (None unless wants_router_logits); warned once per `owner`
    when its gradient is lost (warn_aux_gradient_lost)."""
    if not wants_router_logits(parts, config, requested):
        return None
    if owner is not None:
        warn_aux_gradient_lost(owner, outputs.last_hidden_state, outputs.router_logits)
    return router_aux_loss(outputs.router_logits, _text_config(config), plan, weighting)


def _text_config(config):
    """The config holding the decoder's fields: a vision-language composite's text config, else itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
