"""The prompt-once schedule's attention through a kernel pair: no dense mask, no gathered keys.

zorro_core.attention.external runs the schedule's two kinds of forward against a `KeyRegion`. Where
the actor's varlen backend has a kernel pair (zorro_core.attention.kernels: flash-attn's, torch's
aten flash ops, `flash_cpu` on CPU), they run the split path's calls instead of one masked SDPA call
over the region, so no [T, keys] mask is built and nothing is concatenated:
- capture (phase 1, the packed unique prompts): one self-causal varlen call over the prompts
  (zorro_core.attention.merged.MergedSplitAttention with one call, saving what flash-attn saves);
- attend (phase 2, a micro-batch's responses), `KeptAttention`: two calls merged by log-sum-exp as
  merged.py merges them:
    A. each response causal over its own keys (queries = keys = the micro-batch's row);
    B. the responses of each prompt, as one query segment, against that prompt's kept keys and
       values in place (the leaves, sliced to the micro-batch's span of the packed prompts), no
       causal mask: a response token sees all of its prompt.
  Backward runs each call's kernel backward with the merged output and lse; dq is summed in float32
  (float64 for float64) and rounded once; the leaves' gradients come from call B alone. Saved: q,
  the response row's k and v, the output and the lse (the leaves are referenced, not copied).
Call B needs each prompt's queries adjacent. A micro-batch whose rows are not in prompt order (an
explicit `parts`) runs it through a stable permutation of the queries: a transient copy of q, out
and dout inside each call, never saved.

A sliding window shorter than the longest position + 1 cuts the keys a token may see, which are
then no rectangle: the region keeps its dense masked call for those layers, said once
(`RuntimeWarning`). So do backends without a pair (`reference`, `sdpa`), mask mode, and a `flash_cpu`
dtype whose kernel probe failed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from zorro_core.attention.backends import BACKENDS
from zorro_core.attention.kernels import KernelPair, lse_dtype
from zorro_core.attention.merged import MergedSplitAttention, VarlenCall, _keyless_as_inf, _merge_into
from zorro_core.plan.segments import cu_seqlens

_warned: set[tuple] = set()


def region_pair(backend: Optional[str], dtype: torch.dtype, positions: torch.Tensor, window: Optional[int]):
    """The kernel pair the region runs with (None: its dense masked call), for the actor's varlen
    `backend` (None outside split mode), the compute `dtype` and the forward's token `positions`."""
    be = BACKENDS.get(backend) if backend is not None else None
    pair = be.kernel_pair(dtype) if be is not None else None
    if pair is None:
        return None
    if window is not None and positions.numel() and window < int(positions.max()) + 1:
        key = (backend, window)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"zorro: the prompt-once schedule runs a dense masked call for layers with sliding window {window} "
                f"({backend} otherwise): the window cuts a prompt, so the keys a token sees are not one block",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return pair


def _lengths(ids: torch.Tensor, n: int) -> torch.Tensor:
    """Tokens of each of n contiguous segments numbered 0..n-1 (`ids` ascending per segment)."""
    return torch.bincount(ids, minlength=n)


def capture_attention(region: Any, q, k, v, scale: float, pair: KernelPair) -> torch.Tensor:
    """Phase 1: q [1, Hq, T, D], k, v [1, Hkv, T, D*] of the packed prompts, each causal over itself
    -> [1, T, Hq, Dv]."""
    call = region._varlen.get("capture")
    if call is None:
        seg = region.segment
        n = int(seg.max()) + 1 if seg.numel() else 0
        lens = _lengths(seg, n)
        m = int(lens.max())
        call = VarlenCall(0, seg.numel(), 0, seg.numel(), cu_seqlens(lens), cu_seqlens(lens), m, m, True)
        region._varlen["capture"] = call
    qs, ks, vs = (x[0].transpose(0, 1) for x in (q, k, v))
    return MergedSplitAttention.apply(qs, ks, vs, [call], pair, scale).unsqueeze(0)


@dataclass
class KeptLayout:
    """The two calls of one micro-batch (every layer and the backward reuse them)."""

    cu_own: torch.Tensor
    """[n+1] int32: each response's tokens in the row (call A, queries = keys)."""
    max_own: int
    cu_q: torch.Tensor
    """[m+1] int32: each prompt's queries in prompt order (call B), m prompts of the span."""
    cu_k: torch.Tensor
    """[m+1] int32: each prompt's kept tokens within the span."""
    max_q: int
    max_k: int
    perm: Optional[torch.Tensor]
    """Row tokens in prompt order (stable), or None when they already are."""
    inv: Optional[torch.Tensor]
    """perm's inverse."""
    cache_own: dict = field(default_factory=dict, repr=False)
    cache_cross: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, region: Any) -> "KeptLayout":
        seg, prompt_of = region.segment, region.prompt_of
        p0, p1 = region.prompt_span
        kept_of = region.kept.prompt_of[p0:p1]
        # Two host syncs per micro-batch (once, not per layer): the sizes and the order, then the maxima.
        sizes = torch.stack([seg.max() + 1, kept_of.min(), kept_of.max(), (prompt_of[1:] < prompt_of[:-1]).any()])
        n, g0, g1, unordered = (int(x) for x in sizes.long().tolist())
        m = g1 - g0 + 1
        own = _lengths(seg, n)
        lens_k = _lengths(kept_of - g0, m)
        lens_q = _lengths(prompt_of - g0, m)
        perm = inv = None
        if unordered:
            perm = torch.sort(prompt_of, stable=True).indices
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=perm.device)
        mo, mq, mk = (int(x) for x in torch.stack([own.max(), lens_q.max(), lens_k.max()]).tolist())
        return cls(cu_seqlens(own), mo, cu_seqlens(lens_q), cu_seqlens(lens_k), mq, mk, perm, inv)


def attend_kept(region: Any, q, k, v, kept_k, kept_v, scale: float, pair: KernelPair) -> torch.Tensor:
    """Phase 2: q [1, Hq, T, D], k, v [1, Hkv, T, D*] of the responses, kept_k, kept_v [1, Hkv, Ts, D*]
    (the leaves over the micro-batch's span) -> [1, T, Hq, Dv]."""
    lay = region._varlen.get("attend")
    if lay is None:
        lay = region._varlen["attend"] = KeptLayout.of(region)
    qs, ks, vs, kk, kv = (x[0].transpose(0, 1) for x in (q, k, v, kept_k, kept_v))
    return KeptAttention.apply(qs, ks, vs, kk, kv, lay, pair, scale).unsqueeze(0)


def _permuted(x: torch.Tensor, perm: Optional[torch.Tensor]) -> torch.Tensor:
    return x if perm is None else x.index_select(0, perm)


class KeptAttention(torch.autograd.Function):
    """Calls A and B of the module doc: q [T, Hq, D], k, v [T, Hkv, D*] (the responses), kp, vp
    [Ts, Hkv, D*] (the kept prompts) -> [T, Hq, Dv]."""

    @staticmethod
    def forward(ctx, q, k, v, kp, vp, lay: KeptLayout, pair: KernelPair, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = pair.forward(q, k, v, lay.cu_own, lay.cu_own, lay.max_own, lay.max_own, True, scale, lay.cache_own)
        _keyless_as_inf(lse)
        ob, sb = pair.forward(
            _permuted(q, lay.perm),
            kp.contiguous(),
            vp.contiguous(),
            lay.cu_q,
            lay.cu_k,
            lay.max_q,
            lay.max_k,
            False,
            scale,
            lay.cache_cross,
        )
        if lay.inv is not None:
            ob, sb = ob.index_select(0, lay.inv), sb.index_select(1, lay.inv)
        _merge_into(out, lse, ob, sb)
        ctx.save_for_backward(q, k, v, kp, vp, out, lse)
        ctx.lay, ctx.pair, ctx.scale = lay, pair, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, kp, vp, out, lse = ctx.saved_tensors
        lay, pair, scale = ctx.lay, ctx.pair, ctx.scale
        dout = dout.contiguous()
        dq, dk, dv = pair.backward(
            dout, q, k, v, out, lse, lay.cu_own, lay.cu_own, lay.max_own, lay.max_own, True, scale, lay.cache_own
        )
        perm = lay.perm
        # The CUDA kernels read the lse as a dense [Hq, Tq] block from its data pointer: a permuted
        # (or any) lse handed over is made contiguous first.
        lse_b = lse if perm is None else lse.index_select(1, perm)
        gq, gkp, gvp = pair.backward(
            _permuted(dout, perm),
            _permuted(q, perm),
            kp.contiguous(),
            vp.contiguous(),
            _permuted(out, perm),
            lse_b.contiguous(),
            lay.cu_q,
            lay.cu_k,
            lay.max_q,
            lay.max_k,
            False,
            scale,
            lay.cache_cross,
        )
        if lay.inv is not None:
            gq = gq.index_select(0, lay.inv)
        # Summed in float32 (float64 for float64) and rounded once, as one kernel's accumulators are.
        acc = lse_dtype(q.dtype)
        dq = (dq.to(acc) + gq.to(acc)).to(q.dtype)
        return dq, dk, dv, gkp.to(kp.dtype), gvp.to(vp.dtype), None, None, None


@dataclass
class ChunkLayout:
    """A later chunk of phase 1 through the kernel pair (prompt sharing: nodes are whole prompts).
    Call A: each prompt's tokens in the chunk causal over themselves. Call B: the chunk's first
    `n_cont` tokens (the prompt the chunk's start cuts) against that prompt's kept tokens before the
    chunk, [p0, a) of the packed row, every one visible (all earlier)."""

    cu_own: torch.Tensor
    max_own: int
    n_cont: int
    """Tokens of the cut prompt in this chunk (0: the chunk starts at a prompt's start)."""
    p0: int
    """The cut prompt's first token in the packed row."""
    cache_own: dict = field(default_factory=dict, repr=False)
    cache_cross: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, region: Any) -> "ChunkLayout":
        a, _ = region.chunk
        seg = region.segment
        first = int(seg[0])
        own = _lengths(seg - first, int(seg[-1]) - first + 1)
        kept_of = region.kept.prompt_of
        cut = bool(kept_of[a - 1] == first)
        n_cont = int(own[0]) if cut else 0
        p0 = int((kept_of[:a] == first).nonzero()[0]) if cut else a
        mo = int(own.max())
        return cls(cu_seqlens(own), mo, n_cont, p0)


def chunk_attention(region: Any, q, k, v, kept_k, kept_v, scale: float, pair: KernelPair) -> torch.Tensor:
    """A later chunk of phase 1 (ChunkLayout): q [1, Hq, T, D], k, v [1, Hkv, T, D*] of the chunk,
    kept_k, kept_v [1, Hkv, a, D*] (the leaves before it) -> [1, T, Hq, Dv]."""
    lay = region._varlen.get("chunk")
    if lay is None:
        lay = region._varlen["chunk"] = ChunkLayout.of(region)
    a = region.chunk[0]
    qs, ks, vs = (x[0].transpose(0, 1) for x in (q, k, v))
    kp, vp = (x[0, :, lay.p0 : a].transpose(0, 1) for x in (kept_k, kept_v))
    return ChunkAttention.apply(qs, ks, vs, kp, vp, lay, pair, scale).unsqueeze(0)


class ChunkAttention(torch.autograd.Function):
    """Calls A and B of ChunkLayout merged by log-sum-exp: q [T, Hq, D], k, v [T, Hkv, D*] (the
    chunk), kp, vp [Tk, Hkv, D*] (the cut prompt's kept tokens) -> [T, Hq, Dv]."""

    @staticmethod
    def forward(ctx, q, k, v, kp, vp, lay: ChunkLayout, pair: KernelPair, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = pair.forward(q, k, v, lay.cu_own, lay.cu_own, lay.max_own, lay.max_own, True, scale, lay.cache_own)
        _keyless_as_inf(lse)
        n = lay.n_cont
        if n:
            cu_q = torch.tensor([0, n], dtype=torch.int32, device=q.device)
            cu_k = torch.tensor([0, kp.shape[0]], dtype=torch.int32, device=q.device)
            ctx.cross = (cu_q, cu_k)
            ob, sb = pair.forward(
                q[:n], kp.contiguous(), vp.contiguous(), cu_q, cu_k, n, kp.shape[0], False, scale, lay.cache_cross
            )
            _merge_into(out[:n], lse[:, :n], ob, sb)
        ctx.save_for_backward(q, k, v, out, lse)
        # The kept keys are views of leaves the later chunks write into (their own slices, after this
        # one's): referenced, not saved (a saved view would fail autograd's version check), not copied.
        ctx.kept = (kp, vp)
        ctx.lay, ctx.pair, ctx.scale = lay, pair, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kp, vp = ctx.kept
        lay, pair, scale = ctx.lay, ctx.pair, ctx.scale
        dout = dout.contiguous()
        dq, dk, dv = pair.backward(
            dout, q, k, v, out, lse, lay.cu_own, lay.cu_own, lay.max_own, lay.max_own, True, scale, lay.cache_own
        )
        n = lay.n_cont
        if not n:
            return dq, dk, dv, None, None, None, None, None
        cu_q, cu_k = ctx.cross
        gq, gkp, gvp = pair.backward(
            dout[:n],
            q[:n],
            kp.contiguous(),
            vp.contiguous(),
            out[:n],
            lse[:, :n].contiguous(),
            cu_q,
            cu_k,
            n,
            kp.shape[0],
            False,
            scale,
            lay.cache_cross,
        )
        # Summed in float32 (float64 for float64) and rounded once, as one kernel's accumulators are.
        acc = lse_dtype(q.dtype)
        dq = dq.to(acc)
        dq[:n] += gq.to(acc)
        return dq.to(q.dtype), dk, dv, gkp.to(kp.dtype), gvp.to(vp.dtype), None, None, None
