"""Model presets (real published shapes, random weights), loading, and what the dedup path serves.

Nothing is downloaded: `model_name_or_path` is a local checkpoint directory, a name already in
the local Hugging Face cache, or a preset below. The speed of a model does not depend on its
weights, so presets are built with random weights from their published hyperparameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

# One line per preset: family, then the config fields that differ from the family's defaults.
_QWEN3 = dict(rope_theta=1e6, rms_norm_eps=1e-6, head_dim=128, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=40960)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen/Qwen3-0.6B": ("qwen3", dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True)),
    "Qwen/Qwen3-1.7B": ("qwen3", dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True)),
    "Qwen/Qwen3-4B": ("qwen3", dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=True)),
    "Qwen/Qwen3-8B": ("qwen3", dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32)),
    "Qwen/Qwen3-14B": ("qwen3", dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40)),
    "Qwen/Qwen3-32B": ("qwen3", dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64)),
    "meta-llama/Llama-3.1-8B": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", dict(_QWEN3, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": ("qwen3_next", dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=1e7, vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6)),
    "mistralai/Mistral-7B-v0.1": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=4096)),
    "Qwen/Qwen2.5-7B": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072)),
    # Small shapes of the same architectures: `tiny-*` for tests, `small-*` for CPU benchmarks.
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)),
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)),
    "tiny-qwen2": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)),
    "tiny-qwen3-moe": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=256)),
    "tiny-qwen3-next": ("qwen3_next", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, full_attention_interval=2, vocab_size=256)),
    "tiny-mistral": ("mistral", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, sliding_window=5)),
    "tiny-qwen2-sliding": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "small-qwen3": ("qwen3", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096)),
    "small-qwen3-moe": ("qwen3_moe", dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=4096)),
    "small-qwen3-next": ("qwen3_next", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, full_attention_interval=4, vocab_size=4096)),
}

# Families the dedup path serves: every token-mixing layer is softmax attention through the hook
# (full or sliding window) or a gated DeltaNet layer through zorro_core.models.linear_attention;
# everything else (MLP, MoE experts and router, norms) is token-wise.
SUPPORTED_MODEL_TYPES = {"qwen3", "llama", "qwen2", "mistral", "qwen3_moe", "qwen3_next"}
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
LINEAR_LAYER_TYPES = ("linear_attention",)
# Config fields of attention features the hook does not implement (it would silently skip them).
_UNSUPPORTED_ATTENTION_FEATURES = ("attn_logit_softcapping", "attention_chunk_size", "use_alibi", "alibi")


class UnsupportedModelError(ValueError):
    """The model, or a feature it uses, cannot be run by the dedup path without changing the result."""


def _config_class(family: str):
    from transformers import AutoConfig

    return type(AutoConfig.for_model(family))


def preset_config(name: str, **overrides: Any):
    """The transformers config of preset `name`, with `overrides` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    family, fields = PRESETS[name]
    return _config_class(family)(**{**fields, **overrides})


def build_model(config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0, attn_implementation: str = "sdpa", experts_implementation: Optional[str] = None) -> nn.Module:
    """A causal LM from `config` with seeded random weights.

    MoE experts default to transformers' choice, except in float64 where they run "eager"
    (grouped_mm has no float64 kernel).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {}
    if experts_implementation is None and dtype == torch.float64 and getattr(config, "num_experts", 0):
        experts_implementation = "eager"
    if experts_implementation is not None:
        extra["experts_implementation"] = experts_implementation
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation, **extra)
    return model.to(device)


def _hf_cache_path(name: str) -> Optional[str]:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:
        return None


def load_model(name_or_path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", seed: int = 0) -> nn.Module:
    """A local checkpoint, a model in the local HF cache, or a preset (random weights). Never downloads."""
    from transformers import AutoModelForCausalLM

    path = name_or_path if os.path.isdir(name_or_path) else _hf_cache_path(name_or_path)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True)
        return model.to(device)
    if name_or_path in PRESETS:
        return build_model(preset_config(name_or_path), dtype=dtype, device=device, seed=seed, attn_implementation=attn_implementation)
    raise ValueError(
        f"cannot resolve model {name_or_path!r}: it is not a local directory, not in the local Hugging Face "
        f"cache, and not a preset (nothing is downloaded). Presets: {', '.join(PRESETS)}"
    )


@dataclass
class ModelParts:
    """The pieces of a causal LM the actors drive."""

    base: nn.Module
    """The decoder stack (embeddings, layers, final norm)."""
    lm_head: nn.Linear
    """The output projection."""
    num_attention_layers: int
    """Layers that must call the attention hook once per forward."""
    num_linear_layers: int = 0
    """Gated DeltaNet layers that must go through the linear-attention adapter once per forward."""
    moe: bool = False
    """Whether the model routes tokens to experts (has a router aux loss)."""


def layer_types(config) -> list[str]:
    """The token mixer of each layer, refusing a type the dedup path does not handle."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise UnsupportedModelError(f"config.layer_types has {len(types)} entries for {n} layers")
    for i, t in enumerate(types):
        if t not in ATTENTION_LAYER_TYPES + LINEAR_LAYER_TYPES:
            raise UnsupportedModelError(
                f"layer {i} has type {t!r}, which the dedup path does not handle "
                f"(handled: {', '.join(ATTENTION_LAYER_TYPES + LINEAR_LAYER_TYPES)})"
            )
    return types


def model_parts(model: nn.Module) -> ModelParts:
    """Split a causal LM into base and lm_head, refusing what the dedup path cannot serve.

    A peft-wrapped model (LoRA/QLoRA) is unwrapped to its causal LM; the adapter layers sit
    inside its decoder, so they stay in the graph (zorro_core.stack.lora).
    """
    from zorro_core.stack.lora import unwrap_adapters

    model = unwrap_adapters(model)
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no config: pass a transformers causal LM")
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {mtype!r} is not supported by the dedup path (supported: {sorted(SUPPORTED_MODEL_TYPES)}); "
            "its layers may mix tokens outside the attention hook"
        )
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(lm_head).__module__.startswith("peft."):
        raise UnsupportedModelError(f"lm_head is wrapped by peft ({type(lm_head).__name__}): an adapter on lm_head is not "
                                    "supported by the dedup log-prob path; target the decoder's projections only")
    if base is None or base is model or not isinstance(lm_head, nn.Linear):
        raise ValueError(f"{type(model).__name__} is not a causal LM with a base model and a linear lm_head")
    if getattr(config, "final_logit_softcapping", None):
        raise UnsupportedModelError("final_logit_softcapping is not supported by the dedup log-prob path")
    for name in _UNSUPPORTED_ATTENTION_FEATURES:
        if getattr(config, name, None):
            raise UnsupportedModelError(f"attention feature {name}={getattr(config, name)!r} is not implemented by the dedup attention hook")
    types = layer_types(config)
    from zorro_core.models.moe import is_moe

    return ModelParts(base=base, lm_head=lm_head,
                      num_attention_layers=sum(t in ATTENTION_LAYER_TYPES for t in types),
                      num_linear_layers=sum(t in LINEAR_LAYER_TYPES for t in types), moe=is_moe(config))


def check_layers_served(parts: ModelParts, route) -> None:
    """After a forward: every token-mixing layer went through the hook or its adapter, exactly once."""
    served = {"attention": route.calls,
              "linear_attention": route.adapter_calls.get("linear_attention", 0),
              "linear_conv": route.adapter_calls.get("linear_conv", 0)}
    expected = {"attention": parts.num_attention_layers,
                "linear_attention": parts.num_linear_layers, "linear_conv": parts.num_linear_layers}
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
                raise UnsupportedModelError(f"dropout p={m.p} at {name} in training mode: each copy of a prompt would get its own mask; call model.eval() or set dropout to 0")
        p = getattr(model.config, "attention_dropout", 0.0)
        if p:
            raise UnsupportedModelError(f"attention_dropout={p} in training mode is not supported by the dedup path")
