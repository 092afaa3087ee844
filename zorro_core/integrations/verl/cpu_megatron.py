"""verl's Megatron engine on CPU (gloo), for tests and CI: six narrow answers to CUDA-only calls.

verl 0.9.1's `MegatronEngineWithLMHead` with mbridge (`vanilla_mbridge=True`, the bridge the package
registry serves) and megatron-core 0.16.1 build and run a GPTModel on CPU once these are answered,
each only while CUDA is unavailable (`WORKAROUNDS`; `needed()` probes each against the installed
megatron-core and mbridge, and the megatron suite fails when one is no longer needed, so that it is
removed):

- rng_tracker: `tensor_parallel.model_parallel_cuda_manual_seed` (verl's `set_random_seed` calls it
  whenever the device module counts a device) seeds megatron's RNG tracker with `torch.cuda` states;
  here the tracker holds CPU generator states and forks the CPU generator. The weights are loaded
  from the checkpoint afterwards, and the families served have no dropout.
- current_device: megatron places tensors on `torch.cuda.current_device()` (the rotary embedding's
  `inv_freq`, DDP's gradient buffers), which raises without CUDA; here it answers "cpu" (where it
  would have raised; with `use_cpu_initialization=True` in verl's `override_transformer_config`,
  megatron's own option, the parameters are built on the CPU too).
- cuda_synchronize: megatron's pipeline p2p communication calls `torch.cuda.synchronize()` around
  its shape exchange, which raises without CUDA; here it returns (no device streams to wait for).
- cuda_factories: megatron's pipeline schedules and optimizers build their token counters and loss
  scales with `device="cuda"`; here, for the length of a schedule (verl's `get_forward_backward_func`)
  or of building the optimizer (verl's `get_megatron_optimizer`), such a factory builds on the CPU
  (`CudaFactoriesOnCpu`, a torch function mode).
- mbridge_cuda: mbridge's `get_model` calls `model.cuda(torch.cuda.current_device())`; here that
  one call is skipped (the model is already on the CPU).
- mbridge_local_spec: mbridge asks for the TransformerEngine layer spec, which needs
  TransformerEngine; here it gets megatron's local spec, whose fused norms are separate modules
  (mbridge's weight names are translated: `input_layernorm` is TE's `linear_qkv.layer_norm_weight`,
  `pre_mlp_layernorm` is `linear_fc1.layer_norm_weight`; under sequence parallelism, which megatron's
  local norms refuse, torch's RMSNorm with its weight marked `sequence_parallel`, as TE's are), and
  whose core attention is `thd_reference_attention_class()`: megatron's local `DotProductAttention`,
  which refuses packed (THD) sequences, with THD served by zorro's reference attention (explicit
  softmax, each packed sequence causal over itself), the stand-in for TransformerEngine's kernel
  that verl's packed forward calls. Only where TransformerEngine is not installed.

Importing this module installs them (idempotent); `use_cpu_megatron()` is the same call.
None of it changes what verl computes on a GPU: nothing is active while CUDA is available.
"""

from __future__ import annotations

# Whole over ~500 lines: one CPU stand-in for megatron-core and mbridge, each answer beside the call it
# answers, its probe, and the engine builder the tests and benchmark share; test and CI plumbing.
import contextlib
import importlib.util
import inspect
from typing import Any, Iterator, Optional

import torch

import zorro_core.integrations.verl.needs_megatron  # noqa: F401 -- refuses a missing megatron-core or mbridge

__all__ = [
    "WORKAROUNDS",
    "needed",
    "rotary_emb",
    "thd_reference_attention",
    "thd_reference_attention_class",
    "use_cpu_megatron",
]

WORKAROUNDS = (
    "rng_tracker",
    "current_device",
    "cuda_synchronize",
    "cuda_factories",
    "mbridge_cuda",
    "mbridge_local_spec",
)
"""The gaps of megatron-core and mbridge on CPU this module answers (module doc); `needed()` probes each."""

_TE_TO_LOCAL = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}
"""Local-spec weight names -> the TransformerEngine names mbridge maps to Hugging Face weights."""


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def _has_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# -- rng_tracker ------------------------------------------------------------------------------------


def _cpu_tracker_class() -> type:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's RNG tracker over CPU generator states."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            original = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(original)

    return CpuRNGStatesTracker


def _rng_tracker() -> None:
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    original = mrandom.model_parallel_cuda_manual_seed
    if getattr(original, "_zorro_cpu", False):
        return
    tracker_class = _cpu_tracker_class()

    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        if not _on_cpu():
            return original(seed, *args, **kwargs)
        # megatron's seeds (data-parallel, tensor-parallel rank, expert ranks), CPU states.
        tp = kwargs.get("tp_rank") or mrandom.get_tensor_model_parallel_rank()
        ep = kwargs.get("ep_rank") or mrandom.get_expert_model_parallel_rank()
        etp = kwargs.get("etp_rank") or mrandom.get_expert_tensor_parallel_rank()
        tracker = tracker_class()
        tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
        tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp)
        tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep + etp)
        mrandom._CUDA_RNG_STATE_TRACKER = tracker
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    marked: Any = model_parallel_cuda_manual_seed
    marked._zorro_cpu = True
    marked._zorro_original = original
    mrandom.model_parallel_cuda_manual_seed = marked
    tensor_parallel.model_parallel_cuda_manual_seed = marked


# -- current_device --------------------------------------------------------------------------------


def _current_device() -> None:
    original = torch.cuda.current_device
    if getattr(original, "_zorro_cpu", False):
        return

    def current_device() -> Any:
        if not _on_cpu():
            return original()
        return "cpu"

    marked: Any = current_device
    marked._zorro_cpu = True
    marked._zorro_original = original
    torch.cuda.current_device = marked


def _cuda_synchronize() -> None:
    original = torch.cuda.synchronize
    if getattr(original, "_zorro_cpu", False):
        return

    def synchronize(device: Any = None) -> None:
        if not _on_cpu():
            return original(device)
        return None  # no device streams to wait for

    marked: Any = synchronize
    marked._zorro_cpu = True
    marked._zorro_original = original
    torch.cuda.synchronize = marked


def rotary_emb(rope: Any, positions: torch.Tensor) -> torch.Tensor:
    """megatron's `RotaryEmbedding.get_emb` at the given positions [T] (not 0..T-1): [T, 1, 1, dim]."""
    seq = positions.to(device=rope.inv_freq.device, dtype=rope.inv_freq.dtype)
    if rope.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rope.seq_len_interpolation_factor)
    freqs = torch.outer(seq, rope.inv_freq)
    if not rope.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


# -- mbridge_cuda -----------------------------------------------------------------------------------


class _NoCuda:
    """`torch.nn.Module.cuda` as the identity for the length of mbridge's get_model on CPU."""

    def __enter__(self) -> None:
        self._cuda = torch.nn.Module.cuda
        torch.nn.Module.cuda = lambda module, *a, **k: module  # type: ignore[method-assign]

    def __exit__(self, *exc: Any) -> None:
        torch.nn.Module.cuda = self._cuda  # type: ignore[method-assign]


def _mbridge_cuda() -> None:
    from mbridge.core import bridge

    original = bridge.get_model
    if getattr(original, "_zorro_cpu", False):
        return

    def get_model(*args: Any, **kwargs: Any) -> Any:
        if not _on_cpu():
            return original(*args, **kwargs)
        with _NoCuda():
            return original(*args, **kwargs)

    marked: Any = get_model
    marked._zorro_cpu = True
    marked._zorro_original = original
    bridge.get_model = marked


# -- cuda_factories --------------------------------------------------------------------------------


class CudaFactoriesOnCpu(torch.overrides.TorchFunctionMode):
    """Within: a tensor factory asked for device "cuda" builds on the CPU (megatron's schedules and
    optimizers write `device="cuda"` for their counters and scales)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **kwargs)


def _on_cpu_factories(original: Any) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not _on_cpu():
            return original(*args, **kwargs)
        with CudaFactoriesOnCpu():
            return original(*args, **kwargs)

    marked: Any = wrapped
    marked._zorro_cpu = True
    marked._zorro_original = original
    return marked


def _cuda_factories() -> None:
    from verl.utils.megatron import optimizer as verl_optimizer
    from verl.workers.engine.megatron import transformer_impl

    original = transformer_impl.get_forward_backward_func
    if getattr(original, "_zorro_cpu", False):
        return

    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return _on_cpu_factories(original(*args, **kwargs))

    marked: Any = get_forward_backward_func
    marked._zorro_cpu = True
    marked._zorro_original = original
    transformer_impl.get_forward_backward_func = marked
    verl_optimizer.get_megatron_optimizer = _on_cpu_factories(verl_optimizer.get_megatron_optimizer)


# -- mbridge_local_spec -----------------------------------------------------------------------------


def thd_reference_attention_class() -> type:
    """megatron's local `DotProductAttention` serving packed (THD) sequences through zorro's reference
    attention (`thd_reference_attention`); any other call is megatron's own."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ThdReferenceAttention(DotProductAttention):
        """DotProductAttention; THD through zorro's reference attention (zorro_core.integrations.verl.cpu_megatron)."""

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
            if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
            return thd_reference_attention(query, key, value, packed_seq_params, self.softmax_scale)

    return ThdReferenceAttention


def thd_reference_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: Any, scale: float
) -> torch.Tensor:
    """query [T, Hq, D], key, value [T, Hkv, D] of THD packed sequences -> [T, Hq, D]: each sequence
    (`cu_seqlens_q_padded`) causal over itself; verl pads at the end of a sequence's slot, so no real
    token sees the padding."""
    from zorro_core.attention.backends import BACKENDS
    from zorro_core.plan.segments import Segments

    if packed.cu_seqlens_q_padded is not None:
        cu = packed.cu_seqlens_q_padded
    else:
        cu = packed.cu_seqlens_q
    cu = cu.to(device=query.device, dtype=torch.int32)
    t = query.shape[0]
    if int(cu[-1]) != t:
        raise ValueError(f"THD attention: cu_seqlens end at {int(cu[-1])}, the packed row has {t} tokens")
    longest = int((cu[1:] - cu[:-1]).max())
    seg = Segments(0, torch.arange(t, device=query.device), cu, cu, longest, longest, True, t, t)
    return BACKENDS["reference"].varlen(query, key, value, seg, scale)


def _accepts_vp_stage() -> bool:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm under megatron's sequence parallelism (megatron's local `WrappedTorchNorm`
    refuses it): the weight is marked `sequence_parallel`, so megatron sums its gradient over the
    tensor-parallel ranks (each holds a slice of the sequence), as it does for TransformerEngine's."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        if config.normalization != "RMSNorm":
            raise AssertionError(f"{config.normalization} under sequence parallelism on CPU")
        super().__init__(hidden_size, eps=eps)  # as WrappedTorchNorm builds it
        self.weight.sequence_parallel = True  # type: ignore[attr-defined]


def _local_spec(config: Any, vp_stage: Optional[int]) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sequence_parallel = bool(config.sequence_parallel)
    config.sequence_parallel = False  # megatron's local spec asserts it while it builds the spec only
    try:
        extra = {"vp_stage": vp_stage} if _accepts_vp_stage() else {}
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, **extra)
    finally:
        config.sequence_parallel = sequence_parallel
    attention = thd_reference_attention_class()
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = attention
        if sequence_parallel:
            for name in ("input_layernorm", "pre_mlp_layernorm"):
                if getattr(layer.submodules, name) is WrappedTorchNorm:
                    setattr(layer.submodules, name, SequenceParallelRMSNorm)
            heads = layer.submodules.self_attention.submodules
            for name in ("q_layernorm", "k_layernorm"):
                if getattr(heads, name, None) is WrappedTorchNorm:
                    setattr(heads, name, _HeadRMSNorm)
    if sequence_parallel and spec.layer_norm is WrappedTorchNorm:
        spec.layer_norm = SequenceParallelRMSNorm
    return spec


class _HeadRMSNorm(torch.nn.RMSNorm):
    """The per-head q/k RMSNorm under sequence parallelism (the heads are whole there; megatron
    sums the gradients of `q_layernorm`/`k_layernorm` over tensor-parallel ranks by name)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any):
        super().__init__(hidden_size, eps=eps)  # as WrappedTorchNorm builds it


def _mbridge_local_spec() -> None:
    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge

    original_spec = LLMBridge._get_transformer_layer_spec
    if getattr(original_spec, "_zorro_cpu", False):
        return
    original_names = Bridge._weight_name_mapping_mcore_to_hf

    def _get_transformer_layer_spec(self: Any, vp_stage: Optional[int] = None) -> Any:
        if not _on_cpu() or _has_transformer_engine():
            return original_spec(self, vp_stage)
        # mbridge's own check and attribute (its spec call is the only line replaced)
        if self.config.normalization != "RMSNorm":
            raise AssertionError("only RMSNorm is supported for now")
        self.has_vp_stage = _accepts_vp_stage()
        return _local_spec(self.config, vp_stage)

    def _weight_name_mapping_mcore_to_hf(self: Any, mcore_weights_name: str) -> list[str]:
        for local, te in _TE_TO_LOCAL.items():
            if mcore_weights_name.endswith(local):
                mcore_weights_name = mcore_weights_name[: -len(local)] + te
        return original_names(self, mcore_weights_name)

    for function, original in (
        (_get_transformer_layer_spec, original_spec),
        (_weight_name_mapping_mcore_to_hf, original_names),
    ):
        marked: Any = function
        marked._zorro_cpu = True
        marked._zorro_original = original
    LLMBridge._get_transformer_layer_spec = _get_transformer_layer_spec
    Bridge._weight_name_mapping_mcore_to_hf = _weight_name_mapping_mcore_to_hf


# -- probes and install -----------------------------------------------------------------------------


def _source(function: Any) -> str:
    return inspect.getsource(getattr(function, "_zorro_original", function))


def _raises(function: Any) -> bool:
    if function is None:
        return False
    try:
        function()
    except (RuntimeError, AssertionError):
        return True
    return False


def needed() -> dict[str, bool]:
    """For the installed megatron-core and mbridge on this machine, whether each workaround is still
    needed. A False means upstream answers it now (or CUDA is here): remove the workaround."""
    from mbridge.core import util as mbridge_util
    from mbridge.core.llm_bridge import LLMBridge
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mrandom

    cpu = _on_cpu()
    return {
        "rng_tracker": cpu and "torch.cuda.manual_seed" in _source(mrandom.model_parallel_cuda_manual_seed),
        "current_device": cpu and _raises(getattr(torch.cuda.current_device, "_zorro_original", None)),
        "cuda_synchronize": cpu
        and _raises(getattr(torch.cuda.synchronize, "_zorro_original", None))
        and "torch.cuda.synchronize()" in inspect.getsource(p2p_communication),
        "cuda_factories": cpu and 'device="cuda"' in inspect.getsource(schedules),
        "mbridge_cuda": cpu and ".cuda(torch.cuda.current_device())" in inspect.getsource(mbridge_util.get_model),
        "mbridge_local_spec": cpu
        and not _has_transformer_engine()
        and "use_transformer_engine=True" in _source(LLMBridge._get_transformer_layer_spec),
    }


def use_cpu_megatron() -> None:
    """Install the four answers (idempotent; each is active only without CUDA)."""
    _rng_tracker()
    _current_device()
    _cuda_synchronize()
    _mbridge_cuda()
    _mbridge_local_spec()
    _cuda_factories()


use_cpu_megatron()


# -- building verl's Megatron engine on CPU (tests, benchmarks) -------------------------------------


def build_megatron_engine(
    engine_cls: type,
    model_path: str,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    precision: str = "float32",
    sequence_parallel: bool = False,
    forward_only: bool = False,
    use_remove_padding: bool = True,
) -> Any:
    """`engine_cls(model_config, engine_config, optimizer_config, checkpoint_config)` initialised as
    verl's TrainingWorker does, on CPU over the default process group (tensor parallel x data
    parallel), mbridge's path (`vanilla_mbridge=True`). verl's config accepts bfloat16/float16 only;
    `precision` ("float32", "float64") is set past that check for exact comparisons, with megatron's
    gradient reduction in the same dtype."""
    from types import SimpleNamespace

    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig

    from zorro_core.integrations.verl.cpu import allow_float64, use_cpu_platform

    use_cpu_platform()
    allow_float64()
    use_cpu_megatron()
    model_config = HFModelConfig(path=model_path, load_tokenizer=False)
    model_config.tokenizer = SimpleNamespace(pad_token_id=0)  # verl's forward reads it; no tokenizer here
    engine_config = McoreEngineConfig(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        vanilla_mbridge=True,
        use_remove_padding=use_remove_padding,
        sequence_parallel=sequence_parallel,
        use_distributed_optimizer=False,
        forward_only=forward_only,
        override_transformer_config={"use_cpu_initialization": True, "sequence_parallel": sequence_parallel},
        override_ddp_config={"grad_reduce_in_fp32": precision != "float64"},
    )
    object.__setattr__(engine_config, "dtype", precision)
    engine = engine_cls(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=McoreOptimizerConfig(lr=1e-6, total_training_steps=1),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine
