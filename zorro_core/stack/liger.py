"""Liger kernels on an already-built model, through liger-kernel's own patch functions.

What each patch changes, and what that means for zorro:
- rms_norm, swiglu: the model instance's RMSNorm / MLP forwards become Liger's fused Triton
  kernels. Token-wise, so dedup is unaffected; they run inside the same decoder forward.
- rope: liger replaces `apply_rotary_pos_emb` in the family's modeling module. The attention
  layer still rotates q/k with the cos/sin of zorro's position ids and then calls the
  attention interface, so the hook sees the same (rotated) q/k/v. This patch is module-wide:
  every model of the family in the process uses it until the name is restored
  (LigerResult.restore_module_patches, or the `liger_applied` context manager).
- fused_linear_cross_entropy (FLCE): replaces the CausalLM forward's loss path (lm_head and
  cross-entropy fused, no [tokens, vocab] logits). zorro never calls that forward: its actors
  run the base model and compute log-probs from lm_head themselves, so FLCE has no effect on
  zorro's path and is off by default; zorro's equivalent is logits_mode="memory" (chunked
  lm_head + log-softmax, recomputed in backward). Turn it on only for a trainer's own
  model(labels=...) calls.
Liger's kernels are Triton (CUDA): on CPU, or without liger-kernel, apply_liger refuses with
the reason (liger_unavailable says it up front, for a suite to skip the case).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
from torch import nn

from zorro_core.models.parts import unwrap_adapters
from zorro_core.models.registry import FAMILIES

_MISSING = object()
FLCE_NOTE = (
    "fused_linear_cross_entropy patches the CausalLM forward's loss path, which zorro's actors never call "
    "(they run base + lm_head); no effect on zorro's log-probs: use logits_mode='memory' instead"
)


@dataclass
class LigerSettings:
    """Which Liger kernels to apply (the arguments of liger's apply_liger_kernel_to_* functions)."""

    rope: bool = True
    """Liger RoPE (module-wide patch of apply_rotary_pos_emb)."""
    rms_norm: bool = True
    """Liger RMSNorm on every norm of the instance."""
    swiglu: bool = True
    """Liger SwiGLU MLP on every dense MLP of the instance."""
    fused_linear_cross_entropy: bool = False
    """Liger FLCE on the CausalLM forward; not on zorro's log-prob path (see FLCE_NOTE)."""


@dataclass
class LigerResult:
    """What apply_liger did."""

    function: str
    """The liger function called, e.g. "apply_liger_kernel_to_qwen3"."""
    applied: tuple[str, ...]
    """Kernels passed as True to it."""
    notes: dict[str, str] = field(default_factory=dict)
    """Per kernel: why it was not applied, or what it does not cover (FLCE)."""
    module_patches: dict[str, tuple[Any, Any]] = field(default_factory=dict, repr=False)
    """Names liger replaced in the family's modeling module: name -> (old, new)."""
    module: Any = field(default=None, repr=False)
    """The family's modeling module."""

    def restore_module_patches(self) -> None:
        """Put back the module-wide names liger replaced (instance patches stay on the model)."""
        for name, (old, _) in self.module_patches.items():
            if old is _MISSING:
                delattr(self.module, name)
            else:
                setattr(self.module, name, old)

    def as_row(self) -> dict:
        return {"liger": ",".join(self.applied), "liger_notes": "; ".join(f"{k}: {v}" for k, v in self.notes.items())}


def liger_unavailable(model: nn.Module | str, device: str | torch.device | None = None) -> Optional[str]:
    """Why Liger cannot be applied to `model` (or a model type) here, or None when it can."""
    mtype = model if isinstance(model, str) else getattr(unwrap_adapters(model).config, "model_type", None)
    if mtype in FAMILIES and FAMILIES[mtype].liger_function is None:
        return (
            f"liger-kernel has no patch function for model type {mtype!r} (its transformers integration "
            "covers other families); run this model without Liger"
        )
    if device is None:
        device = next(model.parameters()).device if isinstance(model, nn.Module) else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return f"Liger kernels are Triton kernels and need a CUDA GPU (got {device.type})"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'zorro[gpu]')"
    if mtype not in FAMILIES:
        return f"no Liger patch function for model type {mtype!r} (zorro maps: {', '.join(FAMILIES)})"
    try:  # lazy: liger-kernel is an optional package
        import liger_kernel.transformers as lt
    except Exception as e:  # installed but broken (e.g. a Triton that does not match torch)
        return f"liger_kernel.transformers does not import: {e}"
    function = FAMILIES[mtype].liger_function
    if function is None or not hasattr(lt, function):
        return f"this liger-kernel has no {function} (upgrade liger-kernel)"
    return None


def apply_liger(model: nn.Module, settings: Optional[LigerSettings] = None) -> LigerResult:
    """Apply liger's patch function for the model's family to this model instance (GPU only)."""
    settings = settings or LigerSettings()
    why = liger_unavailable(model)
    if why:
        raise ValueError(why)
    import liger_kernel.transformers as lt  # lazy: optional package, checked above

    model = unwrap_adapters(model)  # liger walks model.<base_model_prefix>.layers of the causal LM
    mtype = model.config.model_type
    fn = getattr(lt, str(FAMILIES[mtype].liger_function))  # not None: liger_unavailable refused that
    accepted = inspect.signature(fn).parameters
    wanted = {
        "rope": settings.rope,
        "rms_norm": settings.rms_norm,
        "swiglu": settings.swiglu,
        "fused_linear_cross_entropy": settings.fused_linear_cross_entropy,
        "cross_entropy": False,
    }
    kwargs, notes = {}, {}
    for name, on in wanted.items():
        if name in accepted:
            kwargs[name] = on  # always explicit: liger's own defaults turn FLCE on
        elif on:
            notes[name] = f"{fn.__name__} has no {name} option"
    if settings.fused_linear_cross_entropy:
        notes["fused_linear_cross_entropy"] = FLCE_NOTE
    module = sys.modules[type(model).__module__]
    before = dict(vars(module))
    fn(model=model, **kwargs)
    patches = {k: (before.get(k, _MISSING), v) for k, v in vars(module).items() if before.get(k, _MISSING) is not v}
    applied = tuple(k for k, v in kwargs.items() if v)
    return LigerResult(fn.__name__, applied, notes, patches, module)


@contextlib.contextmanager
def liger_applied(model: nn.Module, settings: Optional[LigerSettings] = None) -> Iterator[LigerResult]:
    """apply_liger, then restore the module-wide names on exit (so other models of the family are untouched)."""
    result = apply_liger(model, settings)
    try:
        yield result
    finally:
        result.restore_module_patches()
