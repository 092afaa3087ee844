"""verl on CPU, for tests and CI: a CPU platform for verl's trainer and engine, and float64 names.

verl 0.9.1 ships platforms for CUDA, ROCm and NPU only (`verl.plugin.platform`); on a machine
without an accelerator it falls back to "nvidia", and `init_device_mesh("cuda")` fails. verl's
`PlatformRegistry` is its documented plugin seam for new hardware: this module registers
`PlatformCPU` as platform "cpu" (gloo, device "cpu"), which `VERL_PLATFORM=cpu` selects in every
process, and `use_cpu_platform()` sets it in this one. `allow_float64()` lets verl's
`PrecisionType.to_dtype` read "fp64", so that its engine can build a float64 model and FSDP2
mixed-precision policy for exact comparisons.

A whole `verl.trainer.main_ppo` job (Ray workers, the reference, the critic, the rollout) meets six more gaps
on CPU, each answered here only while the platform is this CPU one (`WORKAROUNDS`; `needed()`
says, for the installed verl and torch, which still are, and the verl suite fails when one is
no longer, so that it is removed):

- backend_string: verl builds the process-group backend "cpu:gloo,{device}:{backend}", which on
  device "cpu" is "cpu:gloo,cpu:gloo" and torch refuses (a duplicated device); its two
  `initialize_global_process_group*` functions get "cpu:gloo".
- device_module: verl calls `get_torch_device().mem_get_info/memory_allocated/get_rng_state/...`,
  which `torch.cpu` lacks; the platform's device module is `torch.cpu` with those answered
  (no device memory: zeros and the host's free memory; the RNG state is torch's CPU one).
- pin_memory: verl's FSDP2 engine builds `CPUOffloadPolicy(pin_memory=True)` for the reference
  (forward only), and pinning needs an accelerator; on CPU there is nothing to pin for.
- engine_registry: verl registers its FSDP engines for devices "cuda" and "npu" only; the same
  classes are registered for "cpu".
- value_model_attention: verl's critic loader (`verl.utils.model.load_valuehead_model`) asks
  transformers for `attn_implementation="flash_attention_2"`, whose kernel a CPU lacks; without
  flash_attn the critic is loaded with its config's attention (the `override_config` verl set).
- ipc: not a gap but this platform's answer: `is_ipc_supported()` is False (no CUDA IPC), so
  verl's weight sync into the rollout uses shared memory.

The vLLM side (vLLM's CPU wheel) is in `cpu_vllm`, so that this module imports without vLLM.
For a CPU job, every Ray process loads both through verl's `VERL_USE_EXTERNAL_MODULES`
(`CPU_ENV` gives the environment). None of it is loaded unless a job names it, and none of it
changes what verl computes: these are the answers a CPU gives, for tests and CI.
"""

from __future__ import annotations

# Whole over ~450 lines: one CPU platform, each workaround beside the verl call it answers, and the
# engine/batch builders the tests and benchmarks share; it is test and CI plumbing, not the trainer path.
import inspect
import logging
import os
from types import SimpleNamespace
from typing import Any, Callable

import torch

import zorro_core.integrations.verl.needs  # noqa: F401 -- first: refuses a missing or too old verl

# isort: split
import verl
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.plugin.platform.platform_manager import PlatformRegistry
from verl.utils.torch_dtypes import PrecisionType

from zorro_core.integrations.core import require_attributes, require_parameters
from zorro_core.integrations.verl.plugin import after_import

_RELEASE, _TESTED, _READER = f"verl {verl.__version__}", "verl 0.9.1", "zorro_core.integrations.verl.cpu"
require_attributes(platform_manager, ("_current_platform", "set_platform"), _RELEASE, _TESTED, _READER)
require_attributes(PlatformRegistry, ("register", "get"), _RELEASE, _TESTED, _READER)
# allow_float64 wraps this static method: it must still take the precision name alone.
require_parameters(PrecisionType.to_dtype, ("precision",), _RELEASE, _TESTED, _READER)

__all__ = [
    "CPU_ENV",
    "PLATFORM_NAME",
    "PlatformCPU",
    "WORKAROUNDS",
    "allow_float64",
    "cpu_device_module",
    "needed",
    "on_cpu_platform",
    "use_cpu_platform",
]

PLATFORM_NAME = "cpu"
"""verl's platform name for `PlatformCPU` (`VERL_PLATFORM=cpu`)."""
CPU_ENV = {
    "VERL_PLATFORM": PLATFORM_NAME,
    "VERL_USE_EXTERNAL_MODULES": "zorro_core.integrations.verl.cpu,zorro_core.integrations.verl.cpu_vllm",
}
"""The environment of a CPU `main_ppo` job: every Ray process selects and loads the CPU platform."""
WORKAROUNDS = ("backend_string", "device_module", "pin_memory", "engine_registry", "value_model_attention")
"""The gaps of verl on CPU this module answers (module doc); `needed()` probes each."""

_log = logging.getLogger(__name__)

_DEVICE_NAMES = (
    "empty_cache",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "get_rng_state",
    "set_rng_state",
    "manual_seed",
    "manual_seed_all",
    "set_per_process_memory_fraction",
    "ipc_collect",
    "get_device_name",
)
"""What verl 0.9.1 calls on `get_torch_device()` that a device module may lack."""


def _free_host_memory() -> tuple[int, int]:
    pages, free = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
    size = os.sysconf("SC_PAGE_SIZE")
    return free * size, pages * size


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


_CPU_ANSWERS: dict[str, Callable[..., Any]] = {
    "empty_cache": _no_op,
    "mem_get_info": lambda *a, **k: _free_host_memory(),
    "memory_allocated": _zero,
    "memory_reserved": _zero,
    "max_memory_allocated": _zero,
    "max_memory_reserved": _zero,
    "reset_peak_memory_stats": _no_op,
    "get_rng_state": lambda *a, **k: torch.get_rng_state(),
    "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
    "manual_seed": lambda seed: torch.manual_seed(seed),
    "manual_seed_all": lambda seed: torch.manual_seed(seed),
    "set_per_process_memory_fraction": _no_op,
    "ipc_collect": _no_op,
    "get_device_name": lambda *a, **k: "cpu",
}


def missing_device_functions() -> tuple[str, ...]:
    """The names verl calls that this torch's `torch.cpu` lacks (answered by `cpu_device_module`)."""
    return tuple(name for name in _DEVICE_NAMES if not hasattr(torch.cpu, name))


class _CPUDevice(SimpleNamespace):
    """`torch.cpu` with what it lacks answered (`missing_device_functions`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


def cpu_device_module() -> Any:
    """verl's `get_torch_device()` on CPU: torch.cpu's own functions, the missing ones answered."""
    return _CPUDevice(**{name: _CPU_ANSWERS[name] for name in missing_device_functions()})


_DEVICE = cpu_device_module()


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformCUDA):
    """verl's CUDA platform with every device call answered for the CPU."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {}


def on_cpu_platform() -> bool:
    """Whether this process's verl platform is `PlatformCPU` (resolving it as verl would)."""
    return isinstance(platform_manager.get_platform(), PlatformCPU)


def use_cpu_platform() -> None:
    """Make verl's platform the CPU (call before importing verl's engines or zorro's verl engine)."""
    if not isinstance(platform_manager._current_platform, PlatformCPU):
        platform_manager.set_platform(PlatformCPU())


def allow_float64() -> None:
    """Let verl's precision names include "fp64" (idempotent)."""
    original = PrecisionType.to_dtype
    if getattr(original, "_zorro_fp64", False):
        return

    def to_dtype(precision):
        if precision in ("fp64", "float64", "64", 64, torch.float64):
            return torch.float64
        return original(precision)

    marked: Any = to_dtype  # installed once: a second call sees the mark
    marked._zorro_fp64 = True
    PrecisionType.to_dtype = staticmethod(marked)


# -- the trainer's gaps on CPU (module doc), each active only on PlatformCPU ------------------------

_GROUP_FUNCTIONS = ("initialize_global_process_group", "initialize_global_process_group_ray")
_DISTRIBUTED = "verl.utils.distributed"
_FSDP_IMPL = "verl.workers.engine.fsdp.transformer_impl"
_ENGINE_BACKENDS = ("fsdp", "fsdp2")
_MODEL_UTILS = "verl.utils.model"


def _cpu_backend() -> None:
    import verl.utils.distributed as distributed

    original = distributed.initialize_global_process_group_ray
    if getattr(original, "_zorro_cpu", False):
        return
    require_parameters(original, ("timeout_second", "backend"), _RELEASE, _TESTED, _READER)

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None and on_cpu_platform():
            backend = "cpu:gloo"
        return original(timeout_second=timeout_second, backend=backend)

    marked: Any = initialize_global_process_group_ray
    marked._zorro_cpu = True
    marked._zorro_original = original
    distributed.initialize_global_process_group_ray = marked
    # initialize_global_process_group (verl's torchrun entry points) takes no backend: on CPU,
    # torchrun jobs use verl's Ray path here; its string is checked by `needed()` all the same.


class _CPUOffloadPolicy:
    """verl's `CPUOffloadPolicy(pin_memory=True)` unpinned on PlatformCPU (nothing to pin for)."""

    def __init__(self, original: Any):
        self._original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if on_cpu_platform():
            kwargs["pin_memory"] = False
        return self._original(*args, **kwargs)


def _unpinned_offload() -> None:
    import importlib

    impl = importlib.import_module(_FSDP_IMPL)
    if isinstance(impl.CPUOffloadPolicy, _CPUOffloadPolicy):
        return
    vars(impl)["CPUOffloadPolicy"] = _CPUOffloadPolicy(impl.CPUOffloadPolicy)


def _cpu_engines() -> None:
    from verl.workers.engine.base import EngineRegistry

    for backends in EngineRegistry._engines.values():
        for backend in _ENGINE_BACKENDS:
            keys = backends.get(backend, {})
            if "cuda" in keys and PLATFORM_NAME not in keys:
                keys[PLATFORM_NAME] = keys["cuda"]


def _flash_attn_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is None


def _value_model_attention() -> None:
    import importlib

    utils = importlib.import_module(_MODEL_UTILS)
    original = utils.load_valuehead_model
    if getattr(original, "_zorro_cpu", False):
        return
    require_parameters(
        original, ("local_path", "torch_dtype", "model_config", "trust_remote_code"), _RELEASE, _TESTED, _READER
    )

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        if not on_cpu_platform() or not _flash_attn_missing():
            return original(local_path, torch_dtype, model_config, trust_remote_code)
        from transformers import AutoModelForTokenClassification

        # verl's first choice (a token-classification critic), with the attention its config names.
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation=getattr(model_config, "_attn_implementation", None) or "sdpa",
            trust_remote_code=trust_remote_code,
        )

    marked: Any = load_valuehead_model
    marked._zorro_cpu = True
    marked._zorro_original = original
    setattr(utils, "load_valuehead_model", marked)  # noqa: B010 -- a module attribute verl looks up per call


def needed() -> dict[str, bool]:
    """For the installed verl and torch, whether each workaround is still needed (imports verl's
    FSDP engine). A False means upstream answers it now: remove the workaround."""
    import importlib

    import verl.utils.distributed as distributed
    from verl.workers.engine.base import EngineRegistry

    impl = importlib.import_module(_FSDP_IMPL)
    sources = [
        inspect.getsource(getattr(getattr(distributed, name), "_zorro_original", getattr(distributed, name)))
        for name in _GROUP_FUNCTIONS
    ]
    try:
        torch.empty(1).pin_memory()
        pins = True
    except RuntimeError:
        pins = False
    utils = importlib.import_module(_MODEL_UTILS)
    loader = getattr(utils.load_valuehead_model, "_zorro_original", utils.load_valuehead_model)
    return {
        "value_model_attention": _flash_attn_missing() and '"flash_attention_2"' in inspect.getsource(loader),
        "backend_string": any('f"cpu:gloo,{get_device_name()}' in src for src in sources),
        "device_module": bool(missing_device_functions()),
        "pin_memory": not pins and "CPUOffloadPolicy(pin_memory=True)" in inspect.getsource(impl),
        "engine_registry": not any(
            PLATFORM_NAME in keys and keys[PLATFORM_NAME] is not keys.get("cuda")
            for backends in EngineRegistry._engines.values()
            for backend, keys in backends.items()
            if backend in _ENGINE_BACKENDS
        ),
    }


def install() -> None:
    """Answer the trainer's gaps (module doc) once verl's modules that have them are imported
    (idempotent; each answer applies only while the platform is PlatformCPU)."""
    after_import(_DISTRIBUTED, _cpu_backend)
    after_import(_FSDP_IMPL, _unpinned_offload)
    after_import(_FSDP_IMPL, _cpu_engines)
    after_import(_MODEL_UTILS, _value_model_attention)


install()


# -- building verl's engine and verl's batches on CPU (tests, benchmarks) --------------------------


def save_model(model, path: str) -> str:
    """Save a transformers model where verl's HFModelConfig can load it (one architecture named)."""
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return path


def build_engine(
    engine_cls,
    model_path: str,
    *,
    precision: str = "fp64",
    use_remove_padding: bool = True,
    forward_only: bool = False,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    ulysses_sequence_parallel_size: int = 1,
    model_type: str = "language_model",
):
    """`engine_cls(model_config, engine_config, optimizer_config, checkpoint_config)` initialised as
    verl's TrainingWorker does (FSDP2 over the default process group), on CPU; `model_type`
    "value_model" builds verl's critic (the worker sets it on the model config)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    use_cpu_platform()
    allow_float64()
    model_config = HFModelConfig(
        path=model_path,
        load_tokenizer=False,
        override_config={"attn_implementation": attn_implementation},
        use_remove_padding=use_remove_padding,
        enable_gradient_checkpointing=gradient_checkpointing,
    )
    model_config.model_type = model_type
    engine_config = FSDPEngineConfig(
        strategy="fsdp2",
        model_dtype=precision,
        mixed_precision={"param_dtype": precision, "reduce_dtype": precision, "buffer_dtype": precision},
        use_torch_compile=False,
        forward_only=forward_only,
        ulysses_sequence_parallel_size=ulysses_sequence_parallel_size,
    )
    engine_config.use_remove_padding = use_remove_padding  # as TrainingWorker sets it from the model config
    engine = engine_cls(
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-6),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def padded_batch(prompts: list[list[int]], responses: list[list[int]], seed: int = 0):
    """verl's rollout batch (as `DataProto.to_tensordict()` gives it): prompts left-padded, responses
    right-padded, attention_mask, position_ids from verl's `compute_position_id_with_mask`,
    response_mask, and PPO fields (old_log_probs, advantages) drawn from `seed`."""
    from tensordict import TensorDict
    from verl.utils.model import compute_position_id_with_mask

    b = len(prompts)
    p, r = max(map(len, prompts)), max(map(len, responses))
    prompt_ids = torch.zeros(b, p, dtype=torch.long)
    response_ids = torch.zeros(b, r, dtype=torch.long)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    for i, (pr, rs) in enumerate(zip(prompts, responses)):
        prompt_ids[i, p - len(pr) :] = torch.tensor(pr)
        response_ids[i, : len(rs)] = torch.tensor(rs)
        mask[i, p - len(pr) : p + len(rs)] = 1
    g = torch.Generator().manual_seed(seed)
    response_mask = mask[:, p:].clone()
    return TensorDict(
        {
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], 1),
            "attention_mask": mask,
            "position_ids": compute_position_id_with_mask(mask),
            "response_mask": response_mask,
            "old_log_probs": (-torch.rand(b, r, generator=g, dtype=torch.float64) * 6) * response_mask,
            "advantages": torch.randn(b, r, generator=g, dtype=torch.float64) * response_mask,
        },
        batch_size=b,
    )


def engine_batch(padded, *, temperature: float, calculate_entropy: bool, use_remove_padding: bool, **meta):
    """verl's trainer step on a padded batch: `left_right_2_no_padding`, then the meta data the
    trainer and TrainingWorker attach (`meta` adds or overrides, e.g. use_dynamic_bsz,
    micro_batch_size_per_gpu, max_token_len_per_gpu, global_batch_size)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(padded.clone())
    fields = dict(
        temperature=temperature,
        calculate_entropy=calculate_entropy,
        use_remove_padding=use_remove_padding,
        use_fused_kernels=False,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=4,
        max_token_len_per_gpu=64,
        global_batch_size=len(padded),
    )
    fields.update(meta)
    tu.assign_non_tensor(data, **fields)
    return data
