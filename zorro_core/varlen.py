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

import importlib.util
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .plan import Segments

VarlenFn = Callable[..., torch.Tensor]


def _padded_layout(seg: Segments, device: torch.device) -> dict:
    """Gather indices of the segments as a padded batch, and the allowed-pairs mask; cached on seg."""
    key = ("padded", str(device))
    if key in seg.cache:
        return seg.cache[key]
    lq, lk = seg.lens_q.to(device), seg.lens_k.to(device)
    cq, ck = seg.cu_q.to(device).long(), seg.cu_k.to(device).long()
    aq = torch.arange(seg.max_q, device=device)
    ak = torch.arange(seg.max_k, device=device)
    valid_q = aq[None, :] < lq[:, None]
    valid_k = ak[None, :] < lk[:, None]
    idx_q = torch.where(valid_q, cq[:-1, None] + aq[None, :], 0)
    idx_k = torch.where(valid_k, ck[:-1, None] + ak[None, :], 0)
    # Absolute position of each query among its segment's keys (bottom-right alignment).
    q_abs = aq[None, :] + (lk - lq)[:, None]
    allowed = valid_k[:, None, :] & (ak[None, None, :] <= q_abs[:, :, None])
    # Padding queries would see no key at all (NaN softmax): let them see key 0; their
    # outputs are dropped anyway.
    allowed = allowed | (~valid_q[:, :, None] & (ak[None, None, :] == 0))
    layout = {"idx_q": idx_q, "idx_k": idx_k, "valid_q": valid_q, "q_abs": q_abs, "allowed": allowed}
    seg.cache[key] = layout
    return layout


def _mask(layout: dict, window: Optional[int], max_k: int, device: torch.device) -> torch.Tensor:
    allowed = layout["allowed"]
    if window is not None:
        ak = torch.arange(max_k, device=device)
        near = ak[None, None, :] > layout["q_abs"][:, :, None] - window
        allowed = allowed & (near | ~layout["valid_q"][:, :, None])
    return allowed[:, None]  # [n, 1, Lq, Lk]


def _to_padded(q, k, v, seg: Segments):
    lay = _padded_layout(seg, q.device)
    qp = q[lay["idx_q"]].transpose(1, 2)  # [n, Hq, Lq, D]
    kp = k[lay["idx_k"]].transpose(1, 2)  # [n, Hkv, Lk, D]
    vp = v[lay["idx_k"]].transpose(1, 2)
    return lay, qp, kp, vp


def _from_padded(out_p: torch.Tensor, lay: dict) -> torch.Tensor:
    return out_p.transpose(1, 2)[lay["valid_q"]]  # [Tq, Hq, D]


def reference_varlen(q, k, v, seg: Segments, scale: float, window: Optional[int] = None) -> torch.Tensor:
    lay, qp, kp, vp = _to_padded(q, k, v, seg)
    rep = qp.shape[1] // kp.shape[1]
    kp = kp.repeat_interleave(rep, dim=1)
    vp = vp.repeat_interleave(rep, dim=1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(qp.to(acc), kp.to(acc).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~_mask(lay, window, seg.max_k, q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vp.to(acc)).to(q.dtype)
    return _from_padded(out, lay)


def sdpa_varlen(q, k, v, seg: Segments, scale: float, window: Optional[int] = None) -> torch.Tensor:
    lay, qp, kp, vp = _to_padded(q, k, v, seg)
    out = F.scaled_dot_product_attention(
        qp, kp, vp, attn_mask=_mask(lay, window, seg.max_k, q.device), scale=scale,
        enable_gqa=qp.shape[1] != kp.shape[1],
    )
    return _from_padded(out, lay)


def torch_varlen(q, k, v, seg: Segments, scale: float, window: Optional[int] = None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    left = -1 if window is None else window - 1
    return varlen_attn(
        q, k, v, seg.cu_q.to(q.device), seg.cu_k.to(q.device), seg.max_q, seg.max_k,
        scale=scale, window_size=(left, 0), enable_gqa=q.shape[1] != k.shape[1],
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
