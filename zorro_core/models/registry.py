"""The model families the dedup path serves: one entry each, everything zorro knows of a family.

An entry holds the family's presets (real published shapes, random weights), how a model of
it is checked (the token mixers it may contain, the config features refused), the adapters its
layers need in a deduplicated forward (installed by zorro_core.models.families), its Liger patch
function (called by zorro_core.stack.liger), its `zorro env` line, and how its config's fields
map onto the cost model's ModelShape (`model_shape`: the cost model never reads a config).
Adding a family means adding one entry to FAMILIES (after checking, with the equivalence
tests on a tiny preset, that every token-mixing layer goes through the hook or an adapter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from zorro_core.errors import UnsupportedModelError
from zorro_core.models.linear_attention import LINEAR_LAYER_TYPES, fla_available, install_linear_attention
from zorro_core.plan.cost import ModelShape

# Softmax-attention layer types (transformers' names) that call the attention hook; the hook
# applies a sliding layer's window itself.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Config fields of attention features the hook does not implement (it would silently skip them).
UNSUPPORTED_ATTENTION_FEATURES = ("attn_logit_softcapping", "attention_chunk_size", "use_alibi", "alibi")

# Installs an adapter on a model, once, when an actor takes it (idempotent); it acts only on calls carrying a route.
Adapter = Callable[[nn.Module], None]


@dataclass(frozen=True)
class ModelFamily:
    """What the dedup path knows of one transformers model type."""

    model_type: str
    """transformers' config.model_type."""
    presets: Mapping[str, dict[str, Any]]
    """Preset name -> config fields that differ from the family's defaults."""
    support: Callable[[torch.device], str]
    """How the family runs on a device (a line of `zorro env`)."""
    shape: Callable[[Any], ModelShape]
    """The cost model's description of a model of the family, from its transformers config."""
    liger_function: Optional[str] = None
    """liger_kernel.transformers' patch function for the family (called by zorro_core.stack.liger.apply_liger);
    None where liger has none (refused with that reason)."""
    layer_types: tuple[str, ...] = ATTENTION_LAYER_TYPES
    """Token mixers a model of the family may contain; any other layer type is refused."""
    unsupported_features: tuple[str, ...] = UNSUPPORTED_ATTENTION_FEATURES
    """Config fields that must be unset (features the hook would skip)."""
    adapters: tuple[Adapter, ...] = ()
    """Installed when an actor takes the model (zorro_core.models.families.install_family_adapters): layers
    that mix tokens outside the hook; they act only with a route."""
    router_aux_loss: bool = False
    """Mixture-of-experts blocks with a load-balancing loss (zorro_core.models.moe weights it)."""


def _line(text: str) -> Callable[[torch.device], str]:
    return lambda device: text


def _linear_support(device: torch.device, moe: bool = True) -> str:
    if device.type == "cuda" and fla_available() is None:
        linear = "flash-linear-attention varlen kernel"
    else:
        linear = (
            "PyTorch fallback over a padded batch, slow ("
            + ("fla needs CUDA" if fla_available() is None else "fla not installed")
            + ")"
        )
    return f"ok (gated DeltaNet: {linear}" + ("; MoE aux loss as qwen3_moe)" if moe else ")")


# The cost model's shape of a config, in parts: every family takes `_decoder`, one token mixer
# (`_gqa`, `_gated_gqa` or `_mla`), and where it has them its MoE layers and gated DeltaNet layers.
# A field set by two parts is an error.
ShapePart = Callable[[Any], dict[str, Any]]


def _decoder(config) -> dict[str, Any]:
    # Qwen3.5-MoE has no dense MLP width: every layer is MoE, so no dense layer reads it.
    return dict(
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None) or 0,
        num_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
    )


def _gqa(config) -> dict[str, Any]:
    heads = config.num_attention_heads
    # config.head_dim, where set, is the attention's own (GLM-4.5: 96 x 128 heads, hidden 5120).
    return dict(
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )


def _gated_gqa(config) -> dict[str, Any]:
    # Qwen3-Next and Qwen3.5: q_proj also computes the output gate (no config field says so).
    return dict(_gqa(config), gated_query=True)


def _mla(config) -> dict[str, Any]:
    # DeepSeek-V3's config.head_dim is the rope's width; a head's query/key is the nope and rope parts.
    heads = config.num_attention_heads
    return dict(
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=config.qk_nope_head_dim + config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        q_lora_rank=getattr(config, "q_lora_rank", None) or 0,
        kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim,
    )


def _experts(config, experts: int, shared: int, moe_layers: int) -> dict[str, Any]:
    if not experts:
        return {}
    return dict(
        moe_layers=moe_layers,
        num_experts=experts,
        experts_per_token=getattr(config, "num_experts_per_tok", 0) or 0,
        moe_intermediate_size=getattr(config, "moe_intermediate_size", 0) or 0,
        shared_intermediate_size=shared,
    )


def _qwen_moe(config) -> dict[str, Any]:
    # Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE: layer i is MoE unless in mlp_only_layers, every decoder_sparse_step-th.
    n, experts = config.num_hidden_layers, int(getattr(config, "num_experts", None) or 0)
    only_mlp = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    moe_layers = sum(i not in only_mlp and (i + 1) % step == 0 for i in range(n))
    return _experts(config, experts, getattr(config, "shared_expert_intermediate_size", None) or 0, moe_layers)


def _deepseek_moe(config) -> dict[str, Any]:
    # DeepSeek-V3, GLM-4 MoE: the first first_k_dense_replace layers are dense, the others MoE;
    # n_shared_experts shared experts of the routed experts' width.
    experts = int(getattr(config, "n_routed_experts", None) or 0)
    shared = (getattr(config, "n_shared_experts", None) or 0) * (getattr(config, "moe_intermediate_size", 0) or 0)
    moe_layers = max(0, config.num_hidden_layers - (getattr(config, "first_k_dense_replace", None) or 0))
    return _experts(config, experts, shared, moe_layers)


def _gated_delta_net(config) -> dict[str, Any]:
    return dict(
        num_linear_layers=sum(t in LINEAR_LAYER_TYPES for t in config.layer_types),
        linear_key_heads=config.linear_num_key_heads,
        linear_value_heads=config.linear_num_value_heads,
        linear_key_dim=config.linear_key_head_dim,
        linear_value_dim=config.linear_value_head_dim,
    )


def _shape(*parts: ShapePart) -> Callable[[Any], ModelShape]:
    def shape(config) -> ModelShape:
        fields = _decoder(config)
        for part in parts:
            more = part(config)
            if fields.keys() & more.keys():
                raise TypeError(f"{part.__name__} sets {sorted(fields.keys() & more.keys())}, already set")
            fields.update(more)
        return ModelShape(**fields)

    return shape


_SLIDING = "ok (sliding window by absolute position)"
_SLIDING_TYPES = "ok (sliding and full layers by layer_types, window by absolute position, a rope per layer type)"
_GEMMA3_SUPPORT = "ok (sliding and global layers by layer_types, a rope per layer type; softcapping and bidirectional attention refused)"
# One line per preset: the config fields that differ from the family's defaults.
# fmt: off
# `tiny-*` for tests, `small-*` for CPU benchmarks: small shapes of the same architectures.
_QWEN3 = dict(rope_theta=1e6, rms_norm_eps=1e-6, head_dim=128, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=40960)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
_SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096)
_GEMMA3 = dict(head_dim=256, query_pre_attn_scalar=256, rope_theta=1e6, rope_local_base_freq=1e4, rms_norm_eps=1e-6, vocab_size=262208, max_position_embeddings=131072)
_GEMMA3_LONG = dict(sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0})
_OLMO3_YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192, attention_factor=1.2079441541679836, beta_fast=32, beta_slow=1)
_OLMO3 = dict(rope_theta=5e5, rms_norm_eps=1e-6, vocab_size=100278, max_position_embeddings=65536, sliding_window=4096, eos_token_id=100257, pad_token_id=100277, rope_scaling=_OLMO3_YARN)
# DeepSeek-V3's config sets head_dim to qk_rope_head_dim itself (the rope's width): an explicit one would override it.
_SMALL_NO_HEAD_DIM = {k: v for k, v in _SMALL.items() if k != "head_dim"}
# DeepSeek-V3 and V3.1 (671B) share one config.json; yarn x40 over a 4K original context.
_YARN = dict(rope_type="yarn", rope_theta=1e4, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)
_DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6, rope_parameters=dict(_YARN, factor=40.0, original_max_position_embeddings=4096))
_GLM45 = dict(num_attention_heads=96, num_key_value_heads=8, head_dim=128, partial_rotary_factor=0.5, attention_bias=True, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True, vocab_size=151552, max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-5)
_MOE_NO_AUX = "MoE routing token-wise (sigmoid, group-limited top-k, shared experts); transformers computes no router aux loss for it; liger-kernel has no patch for it"
_MLA = f"ok (MLA: value head dim != query head dim, V zero-padded where a kernel needs one head dim; {_MOE_NO_AUX})"
_GLM_MOE = f"ok (partial rotary; {_MOE_NO_AUX})"

# Qwen3.5: published shapes (the model cards; 0.8B/2B/4B the least certain), text positions through
# the interleaved mRoPE, whose mrope_section splits rotary_dim/2 frequencies (tiny/small: sized to theirs).
_QWEN3_5 = dict(vocab_size=248320, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, max_position_embeddings=262144, rms_norm_eps=1e-6,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10], mrope_interleaved=True))
_TINY_QWEN3_5 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=2, vocab_size=256,
                     rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5, mrope_section=[2, 1, 1], mrope_interleaved=True))
_SMALL_QWEN3_5 = dict({k: v for k, v in _SMALL.items() if k != "intermediate_size"}, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, full_attention_interval=4,
                      rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[3, 3, 2], mrope_interleaved=True))

FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (
    ModelFamily("qwen3", support=_line(_SLIDING), shape=_shape(_gqa), liger_function="apply_liger_kernel_to_qwen3", presets={
        "Qwen/Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
        "Qwen/Qwen3-1.7B": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True),
        "Qwen/Qwen3-4B": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, tie_word_embeddings=True),
        "Qwen/Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
        "Qwen/Qwen3-14B": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40),
        "Qwen/Qwen3-32B": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64),
        "tiny-qwen3": dict(_TINY, head_dim=16),
        "small-qwen3": dict(_SMALL),
    }),
    ModelFamily("llama", support=_line("ok"), shape=_shape(_gqa), liger_function="apply_liger_kernel_to_llama", presets={
        "meta-llama/Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        "tiny-llama": dict(_TINY),
    }),
    ModelFamily("qwen2", support=_line(_SLIDING), shape=_shape(_gqa), liger_function="apply_liger_kernel_to_qwen2", presets={
        "Qwen/Qwen2.5-7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072),
        "tiny-qwen2": dict(_TINY),
        "tiny-qwen2-sliding": dict(_TINY, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    }),
    ModelFamily("mistral", support=_line(_SLIDING), shape=_shape(_gqa), liger_function="apply_liger_kernel_to_mistral", presets={
        "mistralai/Mistral-7B-v0.1": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=4096),
        "tiny-mistral": dict(_TINY, sliding_window=5),
    }),
    ModelFamily("qwen3_moe", support=_line("ok (router aux loss: multiplicity weights by default)"), shape=_shape(_gqa, _qwen_moe),
                liger_function="apply_liger_kernel_to_qwen3_moe", router_aux_loss=True, presets={
        "Qwen/Qwen3-30B-A3B": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
        "tiny-qwen3-moe": dict(_TINY, moe_intermediate_size=32, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        "small-qwen3-moe": dict(_SMALL, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    }),
    ModelFamily("qwen3_next", support=_linear_support, shape=_shape(_gated_gqa, _gated_delta_net, _qwen_moe), liger_function="apply_liger_kernel_to_qwen3_next",
                layer_types=("full_attention",) + LINEAR_LAYER_TYPES, adapters=(install_linear_attention,),
                router_aux_loss=True, presets={
        "Qwen/Qwen3-Next-80B-A3B-Instruct": dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=512, num_experts_per_tok=10, norm_topk_prob=True, full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=1e7, vocab_size=151936, max_position_embeddings=262144, rms_norm_eps=1e-6),
        "tiny-qwen3-next": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, full_attention_interval=2, vocab_size=256),
        "small-qwen3-next": dict(_SMALL, intermediate_size=512, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, full_attention_interval=4),
    }),
    # Gemma 3 text: 5 sliding layers to 1 global (layer_types), a rope per layer type (rope_local_base_freq on
    # sliding layers), scores scaled by query_pre_attn_scalar**-0.5 (the layer hands the hook `scaling`),
    # embeddings scaled by sqrt(hidden_size) inside embed_tokens. Refused: final_logit_softcapping (the log-prob
    # path runs base + lm_head, so it would be skipped), attn_logit_softcapping (the hook has no softcap; this
    # transformers' Gemma3Attention does not even pass it on) and use_bidirectional_attention (not causal).
    # The 4b/12b/27b entries are the text_config of those (multimodal) checkpoints.
    ModelFamily("gemma3_text", support=_line(_GEMMA3_SUPPORT), shape=_shape(_gqa), liger_function="apply_liger_kernel_to_gemma3_text",
                unsupported_features=UNSUPPORTED_ATTENTION_FEATURES + ("use_bidirectional_attention",), presets={
        "google/gemma-3-1b-pt": dict(_GEMMA3, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, sliding_window=512, vocab_size=262144, max_position_embeddings=32768),
        "google/gemma-3-4b-pt": dict(_GEMMA3, **_GEMMA3_LONG, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4),
        "google/gemma-3-12b-pt": dict(_GEMMA3, **_GEMMA3_LONG, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8),
        "google/gemma-3-27b-pt": dict(_GEMMA3, **_GEMMA3_LONG, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168),
        # query_pre_attn_scalar != head_dim and a linear-scaled global rope, so a hook that ignored `scaling` or
        # one rope for all layers would differ from the reference.
        "tiny-gemma3": dict(_TINY, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}),
        "small-gemma3": dict(_SMALL, query_pre_attn_scalar=64, sliding_window=128, layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_theta=1e6, rope_local_base_freq=1e4),
    }),
    # OLMo 3: 3 sliding layers to 1 full (layer_types), YaRN on the full layers' rope; its q/k RMSNorms act on each
    # token's whole projection (token-wise, so packing does not change them).
    ModelFamily("olmo3", support=_line(_SLIDING_TYPES), shape=_shape(_gqa), liger_function="apply_liger_kernel_to_olmo3", presets={
        "allenai/Olmo-3-1025-7B": dict(_OLMO3, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
        "allenai/Olmo-3-1125-32B": dict(_OLMO3, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8),
        "tiny-olmo3": dict(_TINY, num_hidden_layers=3, sliding_window=5, layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_theta=5e5, max_position_embeddings=65536, rope_scaling=_OLMO3_YARN, eos_token_id=2, pad_token_id=1),
        "small-olmo3": dict(_SMALL, sliding_window=128, layer_types=["sliding_attention"] * 3 + ["full_attention"], rope_theta=5e5, eos_token_id=2, pad_token_id=1),
    }),
    # Qwen3.5 (text models): Qwen3-Next's hybrid with separate in_proj_qkv/z/b/a projections, a token-wise
    # sigmoid gate on the attention output, and the interleaved mRoPE (given 2-D text positions: the 1-D rope).
    ModelFamily("qwen3_5_text", support=functools.partial(_linear_support, moe=False), shape=_shape(_gated_gqa, _gated_delta_net), liger_function="apply_liger_kernel_to_qwen3_5",
                layer_types=("full_attention",) + LINEAR_LAYER_TYPES, adapters=(install_linear_attention,), presets={
        "Qwen/Qwen3.5-27B": dict(_QWEN3_5, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48),
        "Qwen/Qwen3.5-9B": dict(_QWEN3_5, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32),
        "Qwen/Qwen3.5-4B": dict(_QWEN3_5, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, linear_num_value_heads=32, tie_word_embeddings=True),
        "Qwen/Qwen3.5-2B": dict(_QWEN3_5, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
        "Qwen/Qwen3.5-0.8B": dict(_QWEN3_5, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16, tie_word_embeddings=True),
        "tiny-qwen3.5": dict(_TINY_QWEN3_5, intermediate_size=64),
        "small-qwen3.5": dict(_SMALL_QWEN3_5, intermediate_size=512),
    }),
    ModelFamily("qwen3_5_moe_text", support=_linear_support, shape=_shape(_gated_gqa, _gated_delta_net, _qwen_moe), liger_function="apply_liger_kernel_to_qwen3_5_moe",
                layer_types=("full_attention",) + LINEAR_LAYER_TYPES, adapters=(install_linear_attention,),
                router_aux_loss=True, presets={
        "Qwen/Qwen3.5-397B-A17B": dict(_QWEN3_5, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, linear_num_value_heads=64, moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=512, num_experts_per_tok=10),
        "Qwen/Qwen3.5-122B-A10B": dict(_QWEN3_5, hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2, linear_num_value_heads=64, moe_intermediate_size=1024, shared_expert_intermediate_size=1024, num_experts=256, num_experts_per_tok=8),
        "Qwen/Qwen3.5-35B-A3B": dict(_QWEN3_5, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8),
        "tiny-qwen3.5-moe": dict(_TINY_QWEN3_5, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
        "small-qwen3.5-moe": dict(_SMALL_QWEN3_5, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2),
    }),
    ModelFamily("deepseek_v3", support=_line(_MLA), shape=_shape(_mla, _deepseek_moe), presets={
        "deepseek-ai/DeepSeek-V3": dict(_DEEPSEEK_V3),
        "deepseek-ai/DeepSeek-V3.1": dict(_DEEPSEEK_V3),
        "moonshotai/Moonlight-16B-A3B": dict(hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, routed_scaling_factor=2.446, first_k_dense_replace=1, norm_topk_prob=True, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e4}),
        # Dq = 16 + 8 = 24 != Dv = 12; layer 0 dense, layer 1 MoE (8 experts in 2 groups); yarn's mscale changes the scaling
        "tiny-deepseek-v3": dict(_TINY, num_key_value_heads=4, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256, rope_parameters=dict(_YARN, factor=4.0, original_max_position_embeddings=64)),
        "small-deepseek-v3": dict(_SMALL_NO_HEAD_DIM, num_key_value_heads=4, moe_intermediate_size=128, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
    }),
    ModelFamily("glm4_moe", support=_line(_GLM_MOE), shape=_shape(_gqa, _deepseek_moe), presets={
        "zai-org/GLM-4.5": dict(_GLM45, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92, n_routed_experts=160, first_k_dense_replace=3, routed_scaling_factor=2.5, use_qk_norm=True),
        "zai-org/GLM-4.5-Air": dict(_GLM45, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=46, n_routed_experts=128, first_k_dense_replace=1, routed_scaling_factor=1.0, use_qk_norm=False),
        # heads x head_dim (4 x 24) != hidden (64), as GLM-4.5's 96 x 128 != 5120; layer 0 dense, layer 1 MoE
        "tiny-glm4-moe": dict(_TINY, head_dim=24, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True),
        "small-glm4-moe": dict(_SMALL, moe_intermediate_size=128, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True, partial_rotary_factor=0.5, attention_bias=True),
    }),
)}
# fmt: on


# Types refused with a reason more useful than "not supported" (what to load instead).
REFUSED_TYPES = {
    "gemma3": "Gemma3ForConditionalGeneration (the multimodal Gemma 3) runs vision tokens with bidirectional "
    "attention outside the causal plan; load the text model instead (model_type gemma3_text, Gemma3ForCausalLM)",
}


def _text_shape(shape: Callable[[Any], ModelShape]) -> Callable[[Any], ModelShape]:
    return lambda config: shape(config.get_text_config())


# Vision-language composites: their text decoder is served as a text family's, text-only batches by the
# actors and images by zorro_core.models.vision (video refused there). No presets: AutoModelForCausalLM
# does not build them (zorro_core.models.vision.tiny_config builds the test shapes).
VISION_LANGUAGE_FAMILIES = {
    f.model_type: f
    for f in (
        ModelFamily(
            "qwen2_5_vl",
            presets={},
            support=_line("ok (images through zorro_core.models.vision; video refused)"),
            shape=_text_shape(_shape(_gqa)),
        ),
        ModelFamily(
            "qwen3_vl",
            presets={},
            support=_line("ok (images and deepstack through zorro_core.models.vision; video refused)"),
            shape=_text_shape(_shape(_gqa)),
        ),
        # Qwen3.5's composites: the text families' layers and adapters (gated DeltaNet through the
        # linear-attention adapter, the MoE router aux loss weighted as for text).
        ModelFamily(
            "qwen3_5",
            presets={},
            support=lambda device: (
                _linear_support(device, moe=False) + " (images through zorro_core.models.vision; video refused)"
            ),
            shape=_text_shape(_shape(_gated_gqa, _gated_delta_net)),
            layer_types=("full_attention",) + LINEAR_LAYER_TYPES,
            adapters=(install_linear_attention,),
        ),
        ModelFamily(
            "qwen3_5_moe",
            presets={},
            support=lambda device: (
                _linear_support(device) + " (images through zorro_core.models.vision; video refused)"
            ),
            shape=_text_shape(_shape(_gated_gqa, _gated_delta_net, _qwen_moe)),
            layer_types=("full_attention",) + LINEAR_LAYER_TYPES,
            adapters=(install_linear_attention,),
            router_aux_loss=True,
        ),
    )
}


def family_of(model_type: str | None) -> ModelFamily:
    """The registry entry of `model_type`, refusing a type the dedup path does not serve."""
    if model_type in VISION_LANGUAGE_FAMILIES:
        return VISION_LANGUAGE_FAMILIES[model_type]
    if model_type in REFUSED_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by the dedup path: {REFUSED_TYPES[model_type]}"
        )
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported by the dedup path (supported: {sorted(FAMILIES)}); "
            "its layers may mix tokens outside the attention hook"
        )
    return FAMILIES[model_type]


def family_support(device: str | torch.device = "cpu") -> dict[str, str]:
    """Each model type the dedup path serves, and how it runs on `device` (for `zorro env`)."""
    device = torch.device(device)
    return {name: f.support(device) for name, f in FAMILIES.items()}


def model_shape(config) -> ModelShape:
    """The cost model's shape of a model from its transformers config, read by the config's family
    (refusing a type the dedup path does not serve, as family_of)."""
    return family_of(getattr(config, "model_type", None)).shape(config)
