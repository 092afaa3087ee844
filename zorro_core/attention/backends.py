"""Variable-length attention: one signature, several backends.

    out = backend(q, k, v, seg, scale=..., window=None)

q [Tq, Hq, D] and k, v [Tk, Hkv, D] hold the segments of `seg` back to back (seg.cu_q,
seg.cu_k). Attention is causal, aligned bottom-right: query i of a segment with Lq queries
and Lk keys sees keys 0..i + Lk - Lq (flash-attn's convention; SDPA's `is_causal` aligns
top-left, which is wrong when Lq != Lk). `window` (if set) also hides keys more than
window - 1 positions behind the query. GQA: Hq must be a multiple of Hkv.

- `reference`: explicit softmax(QK^T)V over a padded batch of segments, softmax in float32
  (float64 for float64 inputs). Exact, runs anywhere; the oracle for the others.
- `sdpa`: the same padded batch through F.scaled_dot_product_attention (CPU or GPU).
- `torch_varlen`: torch.nn.attention.varlen.varlen_attn (CUDA only).
- `flash_attn`: flash_attn.flash_attn_varlen_func (CUDA, needs the flash-attn package).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Callable, Optional

import torch

from zorro_core.attention.padded import attend, from_padded, to_padded
from zorro_core.core.plan import Segments

VarlenFn = Callable[..., torch.Tensor]


def reference_varlen(q, k, v, seg: Segments, scale: float, window: Optional[int] = None) -> torch.Tensor:
    lay, qp, kp, vp = to_padded(q, k, v, seg)
    return from_padded(attend(qp, kp, vp, lay, window, scale, exact=True), lay)


def sdpa_varlen(q, k, v, seg: Segments, scale: float, window: Optional[int] = None) -> torch.Tensor:
    lay, qp, kp, vp = to_padded(q, k, v, seg)
    if seg.q_is_k and window is None:
        # Self-causal segments padded at their end: top-left `is_causal` is then exact for the
        # real queries (padding keys come after them) and lets the kernel skip masked blocks,
        # about half the work of an explicit mask.
        return from_padded(attend(qp, kp, vp, None, None, scale, exact=False), lay)
    return from_padded(attend(qp, kp, vp, lay, window, scale, exact=False), lay)


@functools.lru_cache(maxsize=None)
def _varlen_attn_takes(name: str) -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return name in inspect.signature(varlen_attn).parameters


def torch_varlen(q, k, v, seg: Segments, scale: float, window: Optional[int] = None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    left = -1 if window is None else window - 1
    gqa = {}
    if q.shape[1] != k.shape[1]:
        if _varlen_attn_takes("enable_gqa"):
            gqa["enable_gqa"] = True
        else:
            # torch < 2.12's varlen_attn has no enable_gqa (seen on 2.11 on an H200): expand the
            # K/V heads to the query heads, which is what GQA computes.
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(
        q, k, v, seg.cu_q.to(q.device), seg.cu_k.to(q.device), seg.max_q, seg.max_k,
        scale=scale, window_size=(left, 0), **gqa,
    )


def flash_attn_varlen(q, k, v, seg: Segments, scale: float, window: Optional[int] = None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    left = -1 if window is None else window - 1
    return flash_attn_varlen_func(
        q, k, v, seg.cu_q.to(q.device), seg.cu_k.to(q.device), seg.max_q, seg.max_k,
        softmax_scale=scale, causal=True, window_size=(left, 0),
    )


BACKENDS: dict[str, VarlenFn] = {
    "reference": reference_varlen,
    "sdpa": sdpa_varlen,
    "torch_varlen": torch_varlen,
    "flash_attn": flash_attn_varlen,
}


# Backends that run on a padded batch (any device); the others take cu_seqlens directly.
PADDED = ("reference", "sdpa")


def backend_unavailable(name: str, device: torch.device | str) -> Optional[str]:
    """Why backend `name` cannot run on `device` here, or None when it can."""
    device = torch.device(device)
    if name not in BACKENDS:
        return f"unknown varlen backend {name!r}; choose one of {sorted(BACKENDS)}"
    if name in ("torch_varlen", "flash_attn") and device.type != "cuda":
        return f"{name} needs a CUDA device (got {device.type})"
    if name == "torch_varlen" and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if name == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed (pip install 'zorro[gpu]')"
    return None


def get_backend(name: str, device: torch.device | str) -> VarlenFn:
    why = backend_unavailable(name, device)
    if why:
        raise ValueError(why)
    return BACKENDS[name]


def default_backend(attn_implementation: str, device: torch.device | str) -> str:
    """The varlen backend that split mode uses for a model's attention implementation."""
    device = torch.device(device)
    if attn_implementation == "eager":
        return "reference"
    if attn_implementation.startswith("flash_attention"):
        return "flash_attn"
    if device.type == "cuda" and backend_unavailable("torch_varlen", device) is None:
        return "torch_varlen"
    return "sdpa"
