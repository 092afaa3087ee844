"""The pieces of a causal LM the actors drive, and the checks that refuse what they cannot serve.

`model_parts` finds the model's family in zorro_core.models.registry and checks the model
against it before a forward; `check_layers_served` checks after one that every token-mixing
layer went through the hook or its adapter; `check_trainable_state` refuses training-mode
features that would make copies of a prompt differ.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, cast

import torch
from torch import nn
from transformers import PreTrainedModel

from zorro_core.errors import UnsupportedModelError
from zorro_core.models.linear_attention import LINEAR_LAYER_TYPES
from zorro_core.models.moe import is_moe
from zorro_core.models.registry import ATTENTION_LAYER_TYPES, ModelFamily, family_of


@dataclass
class ModelParts:
    """The pieces of a causal LM the actors drive."""

    base: nn.Module
    """The decoder stack (embeddings, layers, final norm)."""
    lm_head: nn.Linear
    """The output projection."""
    num_attention_layers: int
    """Layers that must call the attention hook once per forward."""
    family: ModelFamily
    """The model's registry entry (its adapters)."""
    num_linear_layers: int = 0
    """Gated DeltaNet layers that must go through the linear-attention adapter once per forward."""
    moe: bool = False
    """Whether the model routes tokens to experts (has a router aux loss)."""


NO_VOCABULARY_HEAD = (
    "the model has no lm_head to compute log-probs with: a critic's value head (its base read through "
    "zorro_core.integrations.value_model.ValueModel) is served by `response_hidden` only, not by the "
    "log-prob paths (forward, forward_backward, the prompt-once schedule)"
)


def vocabulary_head_refusal(parts: ModelParts) -> Optional[str]:
    """Why log-probs cannot be computed through `parts.lm_head` (None: they can). A critic's ValueModel
    shows a stand-in head on the meta device (for the plan's token-id check): its outputs are no numbers."""
    weight = getattr(parts.lm_head, "weight", None)
    return NO_VOCABULARY_HEAD if isinstance(weight, torch.Tensor) and weight.is_meta else None


def unwrap_adapters(model: nn.Module) -> PreTrainedModel:
    """The causal LM inside a peft PeftModel (adapters still injected), else `model` itself."""
    peft = sys.modules.get("peft")  # a PeftModel exists only if peft was imported
    if peft is not None and isinstance(model, peft.PeftModel):
        return cast(PreTrainedModel, model.get_base_model())
    return cast(PreTrainedModel, model)


def layer_types(config, family: ModelFamily) -> list[str]:
    """The token mixer of each layer, refusing a type the family's dedup path does not handle."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise UnsupportedModelError(f"config.layer_types has {len(types)} entries for {n} layers")
    for i, t in enumerate(types):
        if t not in family.layer_types:
            raise UnsupportedModelError(
                f"layer {i} has type {t!r}, which the dedup path does not handle "
                f"(handled in {family.model_type}: {', '.join(family.layer_types)})"
            )
    return types


def model_parts(model: nn.Module) -> ModelParts:
    """Split a causal LM into base and lm_head, refusing what the dedup path cannot serve.

    A peft-wrapped model (LoRA/QLoRA) is unwrapped to its causal LM; the adapter layers sit
    inside its decoder, so they stay in the graph (zorro_core.stack.lora).
    """
    model = unwrap_adapters(model)
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no config: pass a transformers causal LM")
    family = family_of(getattr(config, "model_type", None))
    # A vision-language model's composite config: its decoder's fields are in the text config.
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(lm_head).__module__.startswith("peft."):
        raise UnsupportedModelError(
            f"lm_head is wrapped by peft ({type(lm_head).__name__}): an adapter on lm_head is not "
            "supported by the dedup log-prob path; target the decoder's projections only"
        )
    if base is None or base is model or not isinstance(lm_head, nn.Linear):
        raise ValueError(f"{type(model).__name__} is not a causal LM with a base model and a linear lm_head")
    config = text_config
    if getattr(config, "final_logit_softcapping", None):
        raise UnsupportedModelError("final_logit_softcapping is not supported by the dedup log-prob path")
    if getattr(config, "is_causal", True) is False:  # transformers' switch to bidirectional masks
        raise UnsupportedModelError(
            "config.is_causal=False (bidirectional attention) is not supported: the dedup plan lets a token see "
            "only the tokens before it"
        )
    for name in family.unsupported_features:
        if getattr(config, name, None):
            raise UnsupportedModelError(
                f"attention feature {name}={getattr(config, name)!r} is not implemented by the dedup attention hook"
            )
    types = layer_types(config, family)
    return ModelParts(
        base=base,
        lm_head=lm_head,
        num_attention_layers=sum(t in ATTENTION_LAYER_TYPES for t in types),
        num_linear_layers=sum(t in LINEAR_LAYER_TYPES for t in types),
        moe=family.router_aux_loss and is_moe(config),
        family=family,
    )


def check_layers_served(parts: ModelParts, route) -> None:
    """After a forward: every token-mixing layer went through the hook or its adapter, exactly once."""
    served = {
        "attention": route.calls,
        "linear_attention": route.adapter_calls.get("linear_attention", 0),
        "linear_conv": route.adapter_calls.get("linear_conv", 0),
    }
    expected = {
        "attention": parts.num_attention_layers,
        "linear_attention": parts.num_linear_layers,
        "linear_conv": parts.num_linear_layers,
    }
    if served != expected:
        raise RuntimeError(
            f"the dedup hooks served {served}, expected {expected}: some layer mixes tokens without going "
            "through the attention hook or its adapter, so the packed row would be computed wrong; "
            "this model is not supported"
        )


def check_trainable_state(model: nn.Module) -> None:
    """Refuse what would make copies of a prompt differ (so dedup could not equal the baseline)."""
    if model.training:
        for name, m in model.named_modules():
            if isinstance(m, nn.Dropout) and m.p > 0:
                raise UnsupportedModelError(
                    f"dropout p={m.p} at {name} in training mode: each copy of a prompt would get its own mask; call model.eval() or set dropout to 0"
                )
        p = getattr(model.config, "attention_dropout", 0.0)
        if p:
            raise UnsupportedModelError(f"attention_dropout={p} in training mode is not supported by the dedup path")
