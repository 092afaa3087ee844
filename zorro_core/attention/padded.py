"""Padded-batch attention for the CPU-capable backends (`reference`, `sdpa`).

Segments become a [n, H, L, D] batch: a view when every segment has the same length, one
gather otherwise. The layouts (indices, masks: zorro_core.attention.layouts) are built once per
plan (its `Layouts`), then reused by every layer.

The cross call has its own layout: a response's keys are [its group's prompt | itself]. The
prompt block is gathered once per group and broadcast to the group's responses along the
batch dimension, instead of one row gather per (response, prompt token): on CPU the
backward of a row gather with duplicates (index_add / scatter_add) is slow, the backward of
a broadcast is a plain sum. The gap between a short prompt and the response block is masked.

On CPU the non-exact cross call goes through PyTorch's private CPU flash kernel (_FlashCross),
called with positional arguments: before its first use per dtype, a tiny call of its forward and
backward is checked against float64 softmax attention (cpu_flash_unavailable, cached); when that
fails, the cross call runs the public path (`attend`, F.scaled_dot_product_attention) instead.
The op takes one head dim for q, k and v: with MLA's Dv != Dq it gets them zero-padded to one and
its output cropped (zorro_core.attention.head_dims); `attend` takes unequal dims as they are.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from zorro_core.attention.head_dims import crop, same_head_dim
from zorro_core.attention.layouts import CrossLayout, Layouts, PaddedLayout
from zorro_core.plan.segments import Segments


def pad(x: torch.Tensor, idx: torch.Tensor, uniform: bool, n: int, length: int) -> torch.Tensor:
    """[T, H, D] -> [n, H, L, D]."""
    x = x if uniform else x[idx]
    return x.view(n, length, *x.shape[1:]).transpose(1, 2)


def to_padded(
    q, k, v, seg: Segments, layouts: Optional[Layouts] = None
) -> tuple[PaddedLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The segments' queries and keys/values as a padded batch, over the layout from `layouts`
    (the plan's; None: built for this call alone)."""
    lay = (layouts or Layouts()).padded(seg, q.device)
    n = lay.n
    qp = pad(q, lay.idx_q, lay.uniform_q, n, seg.max_q)
    kp = pad(k, lay.idx_k, lay.uniform_k, n, seg.max_k)
    vp = pad(v, lay.idx_k, lay.uniform_k, n, seg.max_k)
    return lay, qp, kp, vp


def from_padded(out_p: torch.Tensor, lay: PaddedLayout) -> torch.Tensor:
    """[n, H, L, D] -> [T, H, D], padding queries dropped."""
    n, h, length, d = out_p.shape
    out = out_p.transpose(1, 2).reshape(n * length, h, d)
    return out if lay.uniform_q else out[lay.valid_q_flat]


def attend(qp, kp, vp, lay: Optional[PaddedLayout], window: Optional[int], scale: float, exact: bool) -> torch.Tensor:
    """softmax(QK^T * scale + mask) V over a padded batch; lay None means top-left causal.

    exact: explicit scores with softmax in float32 (float64 for float64 inputs), the
    reference; otherwise F.scaled_dot_product_attention.
    """
    if not exact:
        gqa = qp.shape[1] != kp.shape[1]
        if lay is None:
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        mask = lay.mask(window, qp.dtype)
        return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=gqa)
    rep = qp.shape[1] // kp.shape[1]
    kp, vp = kp.repeat_interleave(rep, dim=1), vp.repeat_interleave(rep, dim=1)
    acc = torch.float64 if qp.dtype == torch.float64 else torch.float32
    scores = torch.matmul(qp.to(acc), kp.to(acc).transpose(-1, -2)) * scale
    if lay is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril()
    else:
        mask = lay.mask(window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vp.to(acc)).to(qp.dtype)


def _cross_blocks(q, k, v, seg: Segments, lay: CrossLayout, i0: int = 0, i1: Optional[int] = None):
    """Padded queries [c, Hq, Lq, D] and keys/values [c, Hkv, P_max + Lq, D] ([prompt | own])
    of the cross segments i0..i1 (all by default)."""
    n, tq, lq = lay.n, seg.total_q, seg.max_q
    i1 = n if i1 is None else i1
    idx = lay.idx_q.view(n, lq)[i0:i1].flatten()
    blocks = []
    for x in (k, v):
        rows = x[: lay.gs * lay.p_max] if lay.uniform_p else x[lay.prompt_rows]
        prompt = rows.view(lay.gs, lay.p_max, *x.shape[1:])
        prompt = prompt.expand(i1 - i0, *prompt.shape[1:]) if lay.gs == 1 else prompt[lay.local[i0:i1]]
        own = x[seg.q_start : seg.q_start + tq]
        own = own[i0 * lq : i1 * lq] if lay.uniform_q else own[idx]
        own = own.view(i1 - i0, lq, *x.shape[1:])
        blocks.append(torch.cat([prompt, own], 1).transpose(1, 2))
    qp = (q[i0 * lq : i1 * lq] if lay.uniform_q else q[idx]).view(i1 - i0, lq, *q.shape[1:]).transpose(1, 2)
    return qp, blocks[0], blocks[1]


def _repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    if rep == 1:
        return x
    n, h, length, d = x.shape
    return x[:, :, None].expand(n, h, rep, length, d).reshape(n, h * rep, length, d)


def _chunks(seg: Segments, lay: CrossLayout) -> list[tuple[int, int]]:
    """Runs of cross segments whose [prompt | own] blocks together hold about as many rows as
    all the responses' queries: the rebuilt blocks stay a transient no larger than q."""
    n = lay.n
    size = max(1, seg.total_q // (lay.p_max + seg.max_q))
    return [(i, min(i + size, n)) for i in range(0, n, size)]


class _FlashCross(torch.autograd.Function):
    """The cross call through PyTorch's CPU flash kernel, saving no copy of the prompt's K/V.

    Forward keeps only what the kernel needs besides the packed q/k/v (its output and
    log-sum-exp); backward rebuilds the [prompt | own] blocks, runs the kernel's backward, and
    folds each block's gradient back onto the packed row: the prompt block summed over the
    responses of its group, the own block onto the response's own tokens. Both directions go
    a few responses at a time (_chunks), so the per-response blocks never exist all at once.
    """

    @staticmethod
    def forward(ctx, q, k, v, seg, lay, scale, mask):
        outs, lses = [], []
        for i0, i1 in _chunks(seg, lay):
            qp, kp, vp = _cross_blocks(q, k, v, seg, lay, i0, i1)
            rep = qp.shape[1] // kp.shape[1]
            out_p, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qp, _repeat_heads(kp, rep), _repeat_heads(vp, rep), 0.0, False, attn_mask=mask[i0:i1], scale=scale
            )
            outs.append(out_p)
            lses.append(lse)
        out_p, lse = torch.cat(outs), torch.cat(lses)
        ctx.save_for_backward(q, k, v, out_p, lse)
        ctx.seg, ctx.lay, ctx.scale, ctx.mask, ctx.rep = seg, lay, scale, mask, rep
        return from_padded(out_p, lay)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out_p, lse = ctx.saved_tensors
        seg, lay, rep = ctx.seg, ctx.lay, ctx.rep
        n, h, lq, d = out_p.shape
        if lay.uniform_q:
            gp = grad.reshape(n, lq, h, d)
        else:
            gp = grad.new_zeros(n * lq, h, d).index_put_((lay.valid_q_flat,), grad).view(n, lq, h, d)
        dqs = []
        dk, dv = _Fold(k, seg, lay, rep), _Fold(v, seg, lay, rep)
        for i0, i1 in _chunks(seg, lay):
            qp, kp, vp = _cross_blocks(q, k, v, seg, lay, i0, i1)
            dq_p, dk_p, dv_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gp[i0:i1].transpose(1, 2),
                qp,
                _repeat_heads(kp, rep),
                _repeat_heads(vp, rep),
                out_p[i0:i1],
                lse[i0:i1],
                0.0,
                False,
                attn_mask=ctx.mask[i0:i1],
                scale=ctx.scale,
            )
            dqs.append(dq_p)
            dk.add(dk_p, i0, i1)
            dv.add(dv_p, i0, i1)
        return from_padded(torch.cat(dqs), lay), dk.result(), dv.result(), None, None, None, None


class _Fold:
    """Accumulates gradients of [c, Hq, P_max + Lq, D] key blocks onto the packed [T, Hkv, D] row."""

    def __init__(self, x: torch.Tensor, seg: Segments, lay: CrossLayout, rep: int) -> None:
        self.seg, self.lay, self.rep = seg, lay, rep
        self.out = x.new_zeros(x.shape)
        self.prompt = x.new_zeros(lay.gs, lay.p_max, *x.shape[1:])

    def add(self, dx_p: torch.Tensor, i0: int, i1: int) -> None:
        seg, lay = self.seg, self.lay
        c, hq, _, d = dx_p.shape
        hk = hq // self.rep
        dx_p = dx_p.view(c, hk, self.rep, -1, d).sum(2).transpose(1, 2)  # [c, Lk, Hkv, D]
        prompt, own = dx_p[:, : lay.p_max], dx_p[:, lay.p_max :]
        if lay.gs == 1:
            self.prompt[0] += prompt.sum(0)
        else:
            self.prompt.index_add_(0, lay.local[i0:i1], prompt)
        own = own.reshape(-1, hk, d)
        lq = seg.max_q
        if lay.uniform_q:
            self.out[seg.q_start + i0 * lq : seg.q_start + i1 * lq] += own
        else:  # padding slots point at row 0 and carry exactly zero gradient (masked keys)
            rows = lay.idx_q.view(lay.n, lq)[i0:i1].flatten()
            self.out.index_put_((seg.q_start + rows,), own, accumulate=True)

    def result(self) -> torch.Tensor:
        prompt = self.prompt.reshape(-1, *self.out.shape[1:])
        if self.lay.uniform_p:
            self.out[: prompt.shape[0]] += prompt
        else:  # padded prompt positions carry exactly zero gradient (masked keys)
            self.out.index_put_((self.lay.prompt_rows,), prompt, accumulate=True)
        return self.out


def cross_attention(
    q, k, v, seg: Segments, scale: float, window: Optional[int], exact: bool, layouts: Optional[Layouts] = None
) -> torch.Tensor:
    """Responses of shared groups against [their prompt | themselves].

    q [Tq, Hq, D] holds the responses' queries (seg's query segments); k, v [T, Hkv, D] are
    the whole packed row's keys/values, with the responses' own at seg.q_start onwards.
    """
    lay = (layouts or Layouts()).cross(seg, q.device)
    return cross_blocks_attention(q, k, v, seg, lay, scale, window, exact)


def cross_blocks_attention(
    q, k, v, seg: Segments, lay: CrossLayout, scale: float, window: Optional[int], exact: bool
) -> torch.Tensor:
    """The cross call over `lay`: on CPU, non-exact, through the CPU flash kernel when its probe
    passed for q's dtype (cpu_flash_unavailable); otherwise `attend` over the [prompt | own] blocks."""
    if not exact and q.device.type == "cpu" and cpu_flash_unavailable(q.dtype) is None:
        qf, kf, vf, dv = same_head_dim(q, k, v)  # the op takes one head dim (MLA: zorro_core.attention.head_dims)
        return crop(_FlashCross.apply(qf, kf, vf, seg, lay, scale, lay.mask(window, q.dtype)), dv)
    qp, kp, vp = _cross_blocks(q, k, v, seg, lay)
    return from_padded(attend(qp, kp, vp, lay, window, scale, exact), lay)


# Probe tolerances: the kernel against float64 math on the same (rounded) inputs.
_PROBE_TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@functools.lru_cache(maxsize=None)
def cpu_flash_unavailable(dtype: torch.dtype) -> Optional[str]:
    """None when torch's private CPU flash kernel, forward and backward called as _FlashCross calls
    them, agrees with float64 softmax attention on a tiny masked case in `dtype`; else why not (warned once).
    Probed once per dtype per process."""
    why = probe_cpu_flash(dtype)
    if why is not None:
        warnings.warn(
            f"zorro: the CPU flash kernel is not used for {dtype} cross attention ({why}); "
            "running F.scaled_dot_product_attention over the [prompt | own] blocks instead",
            RuntimeWarning,
            stacklevel=2,
        )
    return why


def probe_cpu_flash(dtype: torch.dtype, forward_op=None, backward_op=None) -> Optional[str]:
    """One call of the ops (torch's by default) on [2, 2, 3, 8] queries and [2, 2, 5, 8] keys with an
    additive -inf mask, forward and backward, against float64 math written out; None if they agree.

    No autograd here: the probe may run inside a checkpointed region (its saved-tensor hooks would
    take the probe's tensors), under no_grad or inference_mode, so the reference gradients are the
    closed form of softmax attention's backward. Autocast is off for the reference.
    """
    try:
        forward_op = forward_op or torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        backward_op = backward_op or torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            g = torch.Generator().manual_seed(0)  # a private generator: the global RNG untouched
            q, k, v, grad = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64).to(dtype) for n in (3, 5, 5, 3))
            qi, ki = torch.arange(3)[:, None], torch.arange(5)[None, :]
            allowed = (ki <= qi + 2).expand(2, 1, 3, 5).clone()
            allowed[1, :, :, 0] = False  # a masked key ahead of the rest (a short prompt's gap)
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
            scale = 0.3
            out, lse = forward_op(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
            dq, dk, dv = backward_op(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale)
            q64, k64, v64, g64 = (t.double() for t in (q, k, v, grad))
            p = torch.softmax(q64 @ k64.transpose(-1, -2) * scale + mask.double(), -1)
            dp = g64 @ v64.transpose(-1, -2)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True))
            want = (p @ v64, ds @ k64 * scale, ds.transpose(-1, -2) @ q64 * scale, p.transpose(-1, -2) @ g64)
        tol = _PROBE_TOL.get(dtype, 5e-2)
        for what, got, ref in zip(("output", "dq", "dk", "dv"), (out, dq, dk, dv), want):
            if got.shape != ref.shape:
                return f"{what} has shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
            err = (got.double() - ref).abs().max().item()
            if not err <= tol:
                return f"{what} differs from float64 softmax attention by {err:.2e} > {tol:g}"
    except Exception as e:  # noqa: BLE001 - any failure of a private op means "not this kernel here"
        return f"{type(e).__name__}: {e}"
    return None
