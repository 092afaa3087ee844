"""A dtype-preserving chunked gated delta rule, for float64 equivalence tests.

transformers' PyTorch fallback (`torch_chunk_gated_delta_rule`) casts to float32 whatever the
model's dtype, so in a float64 model a gradient through it carries float32 noise (measured:
~1e-4 relative on A_log for dedup vs one-shot) and cannot prove exactness at float64's floor.
This is the same algorithm and signature (chunked WY/UT form, chunk 64, qk l2-norm in kernel)
computing in float64 for float64 inputs (float32 otherwise). The equivalence tests and
`zorro verify training` (`exact_delta_rule`) give it to the model's gated DeltaNet layers (that
model only, never transformers' module) for the reference, the baseline and the deduplicated run
alike; a test checks it agrees with transformers' kernel to float32 precision. A plain forward of
such a layer then runs zorro's written-out layer computation (zorro_core.models.linear_attention)
around the chosen kernel; a test checks that computation equals transformers' forward bitwise
for the same kernel. `zorro verify gradients` computes its float64 reference with it, and runs it
in its float64 cases (on CPU); lower-precision cases run transformers' kernel.
"""

from __future__ import annotations

import contextlib
import sys
from types import ModuleType
from typing import Iterator

from torch import nn

from zorro_core.models.exact_delta_rule import chunk_gated_delta_rule_exact as chunk_gated_delta_rule_exact
from zorro_core.models.linear_attention import (
    LINEAR_LAYER_TYPES,
    delta_rule_chosen,
    delta_rule_kernel,
    delta_rule_of,
    fla_available,
)
from zorro_core.models.registry import FAMILIES


def modeling_module(model_type: str) -> ModuleType:
    """transformers' modeling module of the causal LM of `model_type` (imported if it was not)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.for_model(model_type))]
    return sys.modules[cls.__module__]


def linear_family_modules() -> list[ModuleType]:
    """The modeling module of every served family with gated DeltaNet layers (Qwen3-Next, Qwen3.5, ...)."""
    return [modeling_module(t) for t, family in FAMILIES.items() if set(family.layer_types) & set(LINEAR_LAYER_TYPES)]


@contextlib.contextmanager
def exact_delta_rule(model: nn.Module) -> Iterator[None]:
    """Within: the gated DeltaNet layers of `model` run `chunk_gated_delta_rule_exact`, in every
    forward (an actor's, with a route, and a plain one) of this model and of copies made inside the
    block; transformers' modules and other models are untouched (`delta_rule_of`). A model
    without such layers is left as it is."""
    with delta_rule_of(model, lambda module_kernel, query: chunk_gated_delta_rule_exact):
        yield


@contextlib.contextmanager
def device_delta_rule(model: nn.Module) -> Iterator[None]:
    """Within: a plain forward of `model`'s gated DeltaNet layers runs the kernel its tensors' device
    can run. transformers resolves its module kernel to fla's whenever fla is importable, on every
    device, and fla's Triton kernels cannot take CPU tensors; the reference then takes the PyTorch
    function transformers' wrapper keeps behind it (what transformers runs without fla), as zorro's
    adapter does (`delta_rule_kernel`), on this model only (`delta_rule_of`). Without fla, or
    without such layers, nothing changes: the forward is transformers' own. A delta rule already
    chosen for the model's layers (an outer `exact_delta_rule`) is kept: the reference runs it."""
    if fla_available() is not None:  # fla is not importable: transformers' kernel is PyTorch's
        yield
        return
    if delta_rule_chosen(model):
        yield
        return
    with delta_rule_of(model, lambda module_kernel, query: delta_rule_kernel(module_kernel, query)[0]):
        yield
