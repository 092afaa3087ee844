"""verl's Megatron engine served by zorro: `DedupMegatronEngine`, each prompt once per micro-batch.

verl 0.9.1's `MegatronEngineWithLMHead.forward_backward_batch` hands each micro-batch to megatron's
pipeline schedule, which calls the engine's `forward_step(batch_iter, model, ...)`; verl's step packs
the rows as THD (every row whole, positions from 0 per row), runs the GPTModel, and computes
log-probs and entropy with its vocab-parallel functions in a logits processor. `DedupMegatronEngine`
replaces that step only:

- the micro-batch's rows (`zorro_core.integrations.verl.rows.rows_of`, the FSDP engine's reading of
  verl's layout) become zorro's packed prompt plan (`build_prompt_plan`): each distinct prompt once,
  each response after it, one packed row (padded to a multiple of the tensor-parallel size, which
  megatron's sequence parallelism splits; the padding attends to nothing and is never read);
- every layer's core attention is `DedupCoreAttention` (installed on the built model, around the core
  attention of the layer spec): while a plan is routed it runs zorro's split attention over the
  plan (`split_attention`: the reference backend on CPU, the kernel pairs on GPU); otherwise it is
  the layer's own (verl's forward, a fallback);
- RoPE at the plan's positions (a response continues at its prompt's length): the model's own
  `RotaryEmbedding` frequencies at those positions, for the length of the call;
- log-probs and entropy: the logits at the plan's response positions, divided by verl's
  temperature, through verl's own `vocab_parallel_log_probs_from_logits` and
  `vocab_parallel_entropy` (tensor-parallel: the all-reduces of the vocabulary shards), written
  into verl's nested layout (`VerlRows.to_nested`), so verl's loss and postprocessing are unchanged.

Fixed-size micro-batches: rows with the same prompt are first put next to each other (stable),
verl chunks them, the outputs go back to verl's order (as the FSDP engine does). Dynamic
micro-batches (`use_dynamic_bsz=True`): zorro chooses them under verl's token budget counted in the
tokens it computes, groups whole where they fit (`zorro_core.integrations.verl.batching`, the FSDP
engine's), the same count on every data-parallel rank; where a row is not served, verl's own.

Pipeline parallelism: every stage builds the same plan from the same micro-batch; the first stage
embeds the packed row, each stage runs its layers over it, the last computes the log-probs; megatron's
schedule sends the packed hidden states between stages as it sends verl's.

Tensor parallelism: each rank runs its heads over the same plan; megatron's sequence parallelism
splits the padded packed row across the tensor-parallel ranks as it splits verl's.

Refused before any compute, the reason in the error (fail closed): context parallelism > 1 (static
or dynamic), expert parallelism > 1, virtual pipelines, MoE layers, multi-latent attention, sliding
windows, attention output gates, rotary embeddings other than megatron's plain `RotaryEmbedding`
(YaRN, mRoPE), activation recomputation, multi-token prediction, the value model, and `ActorConfig`
options this engine does not implement (`_unserved_options`). Served by verl's own forward with a one-time `DedupFallbackWarning` naming the reason:
what the FSDP engine hands back (`unserved_reason`'s reasons that apply here: fused kernels,
`calculate_sum_pi_squared`, top-k distillation, routed-experts replay, SFT rows, images) and
`pad_to_length`.

Turning it on: `actor_rollout_ref.model.external_lib=zorro_core.integrations.verl.megatron_engine`
with verl's Megatron trainer config (`--config-name ppo_megatron_trainer`,
`actor_rollout_ref.actor.megatron.vanilla_mbridge=True`) (verl imports `external_lib` in each worker
before building its engine; importing this module registers `DedupMegatronEngine` for
`language_model` x `megatron` under this platform's device and vendor, which verl's registry
looks up before verl's own engine).
"""

from __future__ import annotations

import contextlib
import warnings
from functools import partial
from typing import Any, Iterator, Optional

import torch

import zorro_core.integrations.verl.needs  # noqa: F401 -- first: refuses a missing or too old verl
import zorro_core.integrations.verl.needs_megatron  # noqa: F401 -- then megatron-core and mbridge

# isort: split
from megatron.core import parallel_state as mpu
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name, get_vendor
from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits
from verl.utils.megatron_utils import unwrap_model
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from zorro_core.actor.config import ActorConfig
from zorro_core.attention.hook import split_attention
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.core import DedupFallbackWarning, Fallback, require_parameters
from zorro_core.integrations.verl.rows import VerlRows, flag, rows_of, temperature_of
from zorro_core.plan.prompt import PromptPlan, build_prompt_plan

__all__ = ["DedupCoreAttention", "DedupMegatronEngine", "install", "refusal", "routed_plan"]

_RELEASE, _TESTED, _READER = "verl", "verl 0.9.1", "zorro_core.integrations.verl.megatron_engine"
require_parameters(
    MegatronEngineWithLMHead.forward_step,
    ("self", "batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func"),
    _RELEASE,
    _TESTED,
    _READER,
)

_ROUTE: list[Optional["_Route"]] = [None]
"""The plan every `DedupCoreAttention` serves while a dedup forward runs (None: the layer's own)."""


class _Route:
    def __init__(self, plan: PromptPlan, backend: str):
        self.plan, self.backend = plan, backend


@contextlib.contextmanager
def routed_plan(plan: PromptPlan, backend: str) -> Iterator[None]:
    """Within: every `DedupCoreAttention` runs zorro's split attention over `plan`."""
    previous = _ROUTE[0]
    _ROUTE[0] = _Route(plan, backend)
    try:
        yield
    finally:
        _ROUTE[0] = previous


class DedupCoreAttention(torch.nn.Module):
    """A layer's core attention: zorro's split attention over the routed plan, else the layer's own."""

    def __init__(self, inner: torch.nn.Module, scale: float):
        super().__init__()
        self.inner = inner
        """The core attention of the layer spec (verl's forward runs it)."""
        self.scale = scale
        """Softmax scale (the inner attention's)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        route = _ROUTE[0]
        if route is None:
            return self.inner(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
                packed_seq_params=packed_seq_params,
            )
        if packed_seq_params is not None or attention_bias is not None:
            raise UnsupportedModelError("zorro's core attention got packed-sequence params or a bias with a plan")
        # query [T, 1, Hq, D], key/value [T, 1, Hkv, D]; the plan's tokens first, the padding after.
        t, n = query.shape[0], route.plan.num_tokens
        q, k, v = (x[:n, 0] for x in (query, key, value))
        out = split_attention(route.plan, q, k, v, self.scale, None, route.backend)
        if t > n:
            out = torch.cat([out, out.new_zeros((t - n,) + tuple(out.shape[1:]))])
        return out.reshape(t, 1, -1)


_SERVED_OPTIONS = ("varlen_backend",)
"""The ActorConfig fields this engine reads; any other set away from its default is refused."""


def _unserved_options(config: ActorConfig) -> list[str]:
    """The ActorConfig fields set away from their defaults that this engine does not implement
    (e.g. schedule="prompt_once", sharing="prefix", logits modes): refused, never ignored."""
    import dataclasses

    default = ActorConfig()
    return [
        f"{f.name}={getattr(config, f.name)!r}"
        for f in dataclasses.fields(config)
        if f.name not in _SERVED_OPTIONS and getattr(config, f.name) != getattr(default, f.name)
    ]


def _layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = getattr(unwrap_model(module), "decoder", None)
    return list(decoder.layers) if decoder is not None else []


def install_core_attention(chunks: list[torch.nn.Module]) -> int:
    """Wrap every layer's core attention in `DedupCoreAttention` (idempotent); the layers wrapped."""
    count = 0
    for chunk in chunks:
        for layer in _layers(chunk):
            attention: Any = layer.self_attention
            inner: Any = attention.core_attention
            if not isinstance(inner, DedupCoreAttention):
                scale = getattr(inner, "softmax_scale", None)
                if scale is None:
                    raise UnsupportedModelError(f"{type(inner).__name__} has no softmax_scale to reuse")
                attention.core_attention = DedupCoreAttention(inner, float(scale))
            count += 1
    return count


def refusal(engine: MegatronEngineWithLMHead) -> Optional[str]:
    """Why zorro cannot serve this engine's configuration (None: it can), read before any compute."""
    ec, tf = engine.engine_config, engine.tf_config
    checks = [
        (ec.virtual_pipeline_model_parallel_size not in (None, 1), "virtual pipeline parallelism"),
        (ec.context_parallel_size > 1, "context parallelism (context_parallel_size > 1)"),
        (ec.dynamic_context_parallel, "dynamic context parallelism"),
        (ec.expert_model_parallel_size > 1, "expert parallelism (expert_model_parallel_size > 1)"),
        (bool(getattr(tf, "num_moe_experts", None)), "MoE layers (the router's aux loss is not at logical counts yet)"),
        (bool(getattr(tf, "multi_latent_attention", False)), "multi-latent attention"),
        (getattr(tf, "window_size", None) is not None, "sliding-window attention"),
        (bool(getattr(tf, "attention_output_gate", False)), "attention output gates"),
        (getattr(tf, "recompute_granularity", None) is not None, "activation recomputation"),
        (bool(getattr(tf, "mtp_num_layers", None)), "multi-token prediction layers"),
        (getattr(tf, "position_embedding_type", "rope") != "rope", "position embeddings other than RoPE"),
        (bool(getattr(tf, "apply_query_key_layer_scaling", False)), "apply_query_key_layer_scaling"),
        (engine.is_value_model, "a value model (verl's critic)"),
        (getattr(tf, "softmax_type", "vanilla") != "vanilla", "a softmax with an offset"),
    ]
    reasons = [why for bad, why in checks if bad]
    if not reasons:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        for chunk in engine.module:
            rope = getattr(unwrap_model(chunk), "rotary_pos_emb", None)
            if type(rope) is not RotaryEmbedding:
                reasons.append(f"a rotary embedding other than megatron's RotaryEmbedding ({type(rope).__name__})")
                break
    if not reasons:
        return None
    return "zorro's Megatron engine does not serve " + "; ".join(reasons)


@contextlib.contextmanager
def _rope_at(model: torch.nn.Module, positions: torch.Tensor) -> Iterator[None]:
    """Within: the model's rotary embedding answers with its frequencies at `positions` [T]."""
    from zorro_core.integrations.verl.cpu_megatron import rotary_emb

    rope = unwrap_model(model).rotary_pos_emb
    emb = rotary_emb(rope, positions)

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group: Any = None) -> torch.Tensor:
        if max_seq_len != emb.shape[0] or offset or packed_seq:
            raise UnsupportedModelError(
                f"the rotary embedding was asked for {max_seq_len} positions (offset {offset}, packed {packed_seq}); "
                f"the plan has {emb.shape[0]}"
            )
        return emb

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward


class DedupMegatronEngine(MegatronEngineWithLMHead):
    """verl's Megatron language-model engine; its forward step runs each prompt once (module doc).

    `zorro_config` (keyword only), else the config a module named in `external_lib` installed
    (`zorro_core.integrations.verl.engine.install(zorro_config=...)`, as for the FSDP engine), sets
    the options: `varlen_backend` (the attention backend) is read; any other option set away from its
    default (the prompt-once schedule, prefix sharing, logits modes) is refused with its name. `zorro_calls` counts the
    micro-batches served by zorro ("dedup") and by verl's own forward ("fallback")."""

    def __init__(self, *args: Any, zorro_config: Optional[ActorConfig] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if zorro_config is not None and not isinstance(zorro_config, ActorConfig):
            raise TypeError(f"zorro_config must be an ActorConfig, got {type(zorro_config).__name__}")
        if zorro_config is None:
            from zorro_core.integrations.verl.engine import config_for

            zorro_config = config_for(self.model_config.external_lib)
        unserved = _unserved_options(zorro_config)
        if unserved:
            raise UnsupportedModelError(f"zorro's Megatron engine does not serve the ActorConfig options {unserved}")
        self.zorro_config: ActorConfig = zorro_config
        self._zorro_fallback = Fallback("verl's own forward serves this micro-batch")
        self.zorro_calls = self._zorro_fallback.counts

    def initialize(self) -> None:
        super().initialize()
        why = refusal(self)
        if why is not None:
            raise UnsupportedModelError(why)
        install_core_attention(self.module)

    def _zorro_backend(self) -> str:
        """The config's `varlen_backend`, else: the reference attention on CPU (exact, the oracle of
        the others), torch's flash kernel pair on CUDA (flash-attn's where torch's is unavailable)."""
        from zorro_core.attention.backends import backend_unavailable

        if self.zorro_config.varlen_backend is not None:
            return self.zorro_config.varlen_backend
        device = torch.device(get_device_name())
        if device.type != "cuda":
            return "reference"
        return "torch_varlen" if backend_unavailable("torch_varlen", device) is None else "flash_attn"

    def _unserved(self, batch) -> Optional[str]:
        if flag(batch, "use_fused_kernels") or self.engine_config.use_fused_kernels:
            return "use_fused_kernels"
        if flag(batch, "calculate_sum_pi_squared"):
            return "calculate_sum_pi_squared (an output the dedup path does not compute)"
        if flag(batch, "distillation_use_topk") or flag(batch, "distillation_only"):
            return "top-k distillation (teacher tensors over every token)"
        if "routed_experts" in batch.keys() or self.enable_routing_replay:
            return "routed-experts replay"
        if "multi_modal_inputs" in batch.keys() and len(batch["multi_modal_inputs"]):
            return "multi-modal inputs"
        if self.engine_config.pad_to_length:
            return "pad_to_length"
        return None

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        batch = next(batch_iter)
        batch = batch.to(get_device_id())
        reason = self._unserved(batch)
        rows = temperature = None
        if reason is None:
            rows = rows_of(batch)
            temperature = temperature_of(batch)
            reason = rows if isinstance(rows, str) else temperature if isinstance(temperature, str) else None
        from zorro_core.integrations.verl.metrics import stats_of

        stats = self.__dict__.setdefault("_zorro_stats", [])
        if reason is not None:
            self._zorro_fallback.fall_back(reason)
            stats.append(stats_of(batch, None))
            return super().forward_step(iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        assert isinstance(rows, VerlRows) and isinstance(temperature, float)
        output = self._dedup_forward(model, rows, temperature, flag(batch, "calculate_entropy"))
        self._zorro_fallback.served()
        stats.append(stats_of(batch, rows))
        return output, partial(postprocess_micro_batch_func, data=batch, local_cp_size=None)

    def _dedup_forward(self, model, rows: VerlRows, temperature: float, calculate_entropy: bool) -> Any:
        """The micro-batch's packed plan through this pipeline stage: on the last stage verl's
        model output (log-probs, entropy), on the others the hidden states the schedule sends on
        (every stage builds the same plan from the same micro-batch)."""
        plan = build_prompt_plan(rows.batch)
        n = plan.num_tokens
        align = mpu.get_tensor_model_parallel_world_size()
        t = -(-n // align) * align
        input_ids = torch.nn.functional.pad(plan.input_ids, (0, t - n))[None]
        positions = torch.nn.functional.pad(plan.position_ids, (0, t - n))
        with routed_plan(plan, self._zorro_backend()), _rope_at(model, positions):
            logits = model(input_ids=input_ids, position_ids=None, attention_mask=None)
        if not unwrap_model(model).post_process:
            return logits
        # logits [1, T, V / tp]: the response positions, scaled by verl's temperature (float32, cast).
        picked = logits[0, plan.logit_index]
        picked = picked / torch.tensor(temperature, dtype=torch.float32, device=picked.device).to(picked.dtype)
        out = {}
        if calculate_entropy:
            if self.engine_config.entropy_from_logits_with_chunking:
                from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy_with_chunking

                entropy = vocab_parallel_entropy_with_chunking(
                    picked, chunk_size=self.engine_config.entropy_from_logits_chunk_size
                )
            else:
                entropy = vocab_parallel_entropy(picked)
            out["entropy"] = rows.to_nested(plan.scatter_responses(entropy))
        # megatron's cross entropy works in place on float32 logits: a copy where the entropy keeps them (as verl)
        log_probs = vocab_parallel_log_probs_from_logits(picked.clone() if calculate_entropy else picked, plan.labels)
        out["log_probs"] = rows.to_nested(plan.scatter_responses(log_probs))
        return out

    # -- fixed-size micro-batches: rows of a prompt next to each other ----------------------------
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """verl's pass, with rows of a prompt together (module doc) and what zorro saved added to the
        pass's metrics as "zorro/..." where verl returns them (the last pipeline stage)."""
        from zorro_core.integrations.verl.metrics import add_metrics

        self._zorro_stats = []
        output = self._grouped_batch(data, loss_function, forward_only)
        if isinstance(output, dict) and output:
            output = add_metrics(output, self._zorro_stats)
        return output

    def _grouped_batch(self, data, loss_function, forward_only):
        from zorro_core.integrations.verl.engine import _select_rows, prompt_order

        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            from verl.workers.engine.megatron import transformer_impl

            from zorro_core.integrations.verl.batching import swap_prepare_micro_batches

            with swap_prepare_micro_batches(self, transformer_impl, serves=_serves_whole_batch):
                return super().forward_backward_batch(data, loss_function, forward_only)
        order = prompt_order(data)
        if order is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        output = super().forward_backward_batch(tu.index_select_tensor_dict(data, order), loss_function, forward_only)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        model_output = output.get("model_output", {}) if isinstance(output, dict) else {}
        for key, value in list(model_output.items()):
            if isinstance(value, torch.Tensor) and value.shape[0] == order.numel():
                model_output[key] = _select_rows(value, inverse)
        return output


def _serves_whole_batch(engine: DedupMegatronEngine, data: Any) -> bool:
    """Whether this engine's forward serves every row of `data` (then zorro chooses the dynamic
    micro-batches by the tokens it computes; else verl's own micro-batching runs, on every rank)."""
    if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        return False
    if not data["input_ids"].is_nested or engine._unserved(data) is not None:
        return False
    if isinstance(rows_of(data), str):
        return False
    return "temperature" not in data.keys() or not isinstance(temperature_of(data), str)


def install(device: Any = None, vendor: Any = None) -> type:
    """Register `DedupMegatronEngine` for language models on megatron under this platform's (device,
    vendor) key (idempotent), which verl's registry looks up before verl's own engine."""
    device = device or get_device_name()
    vendor = vendor or get_vendor() or device
    keys = EngineRegistry._engines.get("language_model", {}).get("megatron", {})
    current = keys.get((device, vendor))
    if current is DedupMegatronEngine:
        return DedupMegatronEngine
    if current is not None:
        warnings.warn(
            f"zorro: verl already has a {vendor} language-model engine for megatron on {device} "
            f"({current.__name__}); zorro's engine is not installed for it",
            DedupFallbackWarning,
            stacklevel=2,
        )
        return DedupMegatronEngine
    EngineRegistry.register(model_type="language_model", backend="megatron", device=device, vendor=vendor)(
        DedupMegatronEngine
    )
    return DedupMegatronEngine


install()
