"""Model presets (real published shapes, random weights) and loading.

Nothing is downloaded: `model_name_or_path` is a local checkpoint directory, a name already in
the local Hugging Face cache, or a preset of a family in zorro_core.models.registry. The speed
of a model does not depend on its weights, so presets are built with random weights from their
published hyperparameters.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from typing import Any, Iterator, Optional

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from zorro_core.models.local_files import hub_offline, local_checkpoint
from zorro_core.models.moe import routed_experts
from zorro_core.models.registry import FAMILIES

# Every preset of every family: name -> (model type, config fields).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    name: (family.model_type, fields) for family in FAMILIES.values() for name, fields in family.presets.items()
}


class RandomWeightsWarning(UserWarning):
    """A hub name was loaded as zorro's preset of that shape, with random weights (it is not in the local cache)."""


def weights_source(name_or_path: str) -> str:
    """Where `load_model(name_or_path)` takes its weights: "checkpoint" (a local directory or the local
    Hugging Face cache) or "random" (a preset). Unresolvable names raise as in load_model."""
    if local_checkpoint(name_or_path) is not None:
        return "checkpoint"
    if name_or_path in PRESETS:
        return "random"
    raise ValueError(f"cannot resolve model {name_or_path!r}: not a local directory, not cached, not a preset")


def _config_class(family: str):
    return type(AutoConfig.for_model(family))


def preset_config(name: str, **overrides: Any):
    """The transformers config of preset `name`, with `overrides` applied."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    family, fields = PRESETS[name]
    # A copy: a config keeps the lists it is given (layer_types), which must not be the preset's own.
    return _config_class(family)(**copy.deepcopy({**fields, **overrides}))


def build_model(
    config,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    experts_implementation: Optional[str] = None,
) -> PreTrainedModel:
    """A causal LM from `config` with seeded random weights.

    The weights are drawn from the seed in a private RNG state: the caller's global RNG state is
    the same after the call as before (see seeded_rng).
    MoE experts default to transformers' choice, except in float64 where they run "eager"
    (grouped_mm has no float64 kernel).
    """
    extra = {}
    # A composite (multimodal) config builds its text model, whose config holds the experts.
    if experts_implementation is None and dtype == torch.float64 and routed_experts(config.get_text_config()):
        experts_implementation = "eager"
    if experts_implementation is not None:
        extra["experts_implementation"] = experts_implementation
    with seeded_rng(seed):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation, **extra)
    nn.Module.to(model, device)  # in place (transformers types its own .to for dtype casts only)
    return model


@contextlib.contextmanager
def seeded_rng(seed: int) -> Iterator[None]:
    """Within: torch's global generators seeded with `seed`; on exit, the caller's states put back.

    transformers initialises weights through torch.nn.init, which takes no generator, so the seed
    goes into the global generator of the CPU (where from_config builds) and of every CUDA device
    already initialised, each forked first (torch.random.fork_rng) and restored on exit. The
    weights are those `torch.manual_seed(seed)` before from_config gives.
    """
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        for d in cuda:
            torch.cuda.default_generators[d].manual_seed(seed)
        yield


def load_model(
    name_or_path: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    seed: int = 0,
) -> PreTrainedModel:
    """A local checkpoint, a model in the local HF cache, or a preset (random weights). Never downloads,
    never runs code from the checkpoint (zorro_core.models.local_files)."""
    if os.path.isdir(name_or_path) and name_or_path in PRESETS:
        # A local directory wins, as in transformers, but a preset name must not be shadowed unseen.
        if not os.path.isfile(os.path.join(name_or_path, "config.json")):
            raise ValueError(
                f"{name_or_path!r} is a preset, but a directory of that name is in {os.getcwd()!r} and holds no "
                "config.json, so neither can be loaded; rename the directory or run from another one"
            )
        warnings.warn(
            f"loading the checkpoint in the local directory {os.path.abspath(name_or_path)!r}, not the preset "
            f"{name_or_path!r} (a local directory shadows a preset of the same name)",
            stacklevel=2,
        )
    path = local_checkpoint(name_or_path)
    if path is not None and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"model {name_or_path!r} is not a model directory: {os.path.abspath(path)!r} holds no config.json "
            "(a checkpoint directory holds config.json and the weights); give a checkpoint directory, a model in "
            f"the local Hugging Face cache, or a preset ({', '.join(PRESETS)})"
        )
    if path is not None:
        with hub_offline():
            model = AutoModelForCausalLM.from_pretrained(
                path,
                dtype=dtype,
                attn_implementation=attn_implementation,
                local_files_only=True,
                trust_remote_code=False,
            )
        nn.Module.to(model, device)  # in place
        return model
    if name_or_path in PRESETS:
        if "/" in name_or_path:
            # A hub name reads as the published model; its log-probs here are noise (timings and memory are not).
            warnings.warn(
                f"{name_or_path!r} is not in the local Hugging Face cache: building zorro's preset of its published "
                "shape with random weights (speed and memory are the model's; log-probs and losses are not). "
                "Download it first (huggingface-cli download) to load the real weights.",
                RandomWeightsWarning,
                stacklevel=2,
            )
        return build_model(
            preset_config(name_or_path), dtype=dtype, device=device, seed=seed, attn_implementation=attn_implementation
        )
    raise ValueError(
        f"cannot resolve model {name_or_path!r}: it is not a local directory, not in the local Hugging Face "
        f"cache, and not a preset (nothing is downloaded). Presets: {', '.join(PRESETS)}"
    )
