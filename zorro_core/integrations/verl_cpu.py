"""verl on CPU, for tests and benchmarks: a CPU platform and float64 precision names.

verl 0.9.1 ships platforms for CUDA, ROCm and NPU only (`verl.plugin.platform`); on a machine
without an accelerator it falls back to "nvidia", and `init_device_mesh("cuda")` fails. verl's
`PlatformRegistry` is its documented plugin seam for new hardware: `use_cpu_platform()` sets a
CPU platform (gloo, device "cpu") built on it, before anything asks verl for the platform.
`allow_float64()` lets verl's `PrecisionType.to_dtype` read "fp64" (verl knows fp16/bf16/fp32 only),
so that its engine can build a float64 model and FSDP2 mixed-precision policy for exact comparisons.
Neither changes what verl computes; both are for CPU runs of verl's own engine code.
"""

from __future__ import annotations

from typing import Any

import torch

import zorro_core.integrations.needs_verl  # noqa: F401 -- first: refuses a missing or too old verl

# isort: split
import verl
from verl.plugin.platform import platform_manager
from verl.plugin.platform.platform_cuda import PlatformCUDA
from verl.utils.torch_dtypes import PrecisionType

from zorro_core.integrations.core import require_attributes, require_parameters

_RELEASE, _TESTED, _READER = f"verl {verl.__version__}", "verl 0.9.1", "zorro_core.integrations.verl_cpu"
require_attributes(platform_manager, ("_current_platform", "set_platform"), _RELEASE, _TESTED, _READER)
# allow_float64 wraps this static method: it must still take the precision name alone.
require_parameters(PrecisionType.to_dtype, ("precision",), _RELEASE, _TESTED, _READER)


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
        return torch.cpu

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
):
    """`engine_cls(model_config, engine_config, optimizer_config, checkpoint_config)` initialised as
    verl's TrainingWorker does (FSDP2 over the default process group), on CPU."""
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
