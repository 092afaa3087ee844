"""Contract stand-ins for the GPU kernels zorro calls, so their glue runs end to end on CPU.

Each stand-in has the real function's signature, refuses every input the real kernel refuses
(or would compute wrong with), and computes the exact result with plain, differentiable torch
ops (softmax in float32, float64 for float64 inputs). Tests install them by monkeypatching
(`install_flash_attn`, `install_torch_varlen`, `install_fla`); nothing here is in the package.

- `flash_attn_varlen_func` (flash-attn 2.x): q [Tq, Hq, D], k, v [Tk, Hkv, D] on one device,
  fp16/bf16 only, all the same dtype, last dim contiguous, D <= 256; cu_seqlens int32 1-D on
  q's device, starting at 0, ending at Tq / Tk; max_seqlen Python ints at least the longest
  segment; Hq a multiple of Hkv; window_size a (left, right) tuple, -1 = unbounded; causal
  aligned bottom-right (query i of a segment with Lq queries and Lk keys sits at key position
  i + Lk - Lq), and the window is counted from that aligned position.
- `torch.nn.attention.varlen.varlen_attn` (torch 2.13): the same tensor contract (it calls the
  same flash kernel); `enable_gqa=True` is needed when Hq != Hkv (and Hq % Hkv == 0); the causal
  flag is `window_size == (-1, 0)` compared as a tuple (a list silently turns causality off).
- The kernel pairs under them (zorro_core.attention.kernels), which the gather-free split path calls:
  flash-attn 2.7's `_flash_attn_varlen_forward/_backward` (`install_flash_attn` puts them in a
  `flash_attn.flash_attn_interface` module) and torch's `aten._flash_attention_forward/_backward`
  (`install_torch_varlen` gives the torch_varlen pair stand-in ops that bind their arguments to the
  installed torch's own op schemas). The same tensor contract as above, head dims a multiple of 8
  (the private calls take what the public wrappers pad), causal a bool; forward returns the lse as
  [Hq, Tq] float32; backward takes dout, out and lse as the caller gives them and computes flash's
  backward from them (P = exp(S - lse), D = rowsum(dout * out)), so a wrong lse or out handed back is
  a wrong gradient, as on the GPU. flash-attn's backward writes into the dq, dk, dv it is given.
- fla's `chunk_gated_delta_rule` with `cu_seqlens` (flash-linear-attention 0.2+): q, k [1, T, H, K],
  v [1, T, HV, V], g, beta [1, T, HV] (batch 1 when cu_seqlens is given), HV a multiple of H;
  cu_seqlens a LongTensor on q's device from 0 to T; initial_state [N, HV, K, V] with N the
  number of sequences; returns (o [1, T, HV, V], final_state [N, HV, K, V] in float32 or None).
  Computed per sequence with tests/delta_rule.py's chunk_gated_delta_rule_exact (each
  sequence chunked from its own start, as fla does).
"""

from __future__ import annotations

import importlib.machinery
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Optional

import torch

from zorro_core.verify.delta_rule import chunk_gated_delta_rule_exact

HALF = (torch.float16, torch.bfloat16)


class ContractError(AssertionError):
    """A call the real kernel would refuse or compute wrong."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ContractError(what)


@dataclass
class Calls:
    """What a stand-in saw, for the tests to assert it was really used."""

    n: int = 0
    windows: list = field(default_factory=list)


def _check_cu(cu, name: str, total: int, max_len, device, dtype) -> torch.Tensor:
    _require(
        isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2,
        f"{name} must be a 1-D tensor of n+1 offsets",
    )
    _require(cu.dtype == dtype, f"{name} must be {dtype}, got {cu.dtype}")
    _require(cu.device == device, f"{name} must be on the queries' device {device}, got {cu.device}")
    _require(
        int(cu[0]) == 0 and int(cu[-1]) == total, f"{name} must run from 0 to {total}, got {int(cu[0])}..{int(cu[-1])}"
    )
    lens = cu[1:] - cu[:-1]
    _require(bool((lens >= 0).all()), f"{name} must be non-decreasing")
    if max_len is not None:
        _require(type(max_len) is int, f"the max length for {name} must be a Python int, got {type(max_len).__name__}")
        _require(
            max_len >= int(lens.max()), f"max length {max_len} is below the longest segment {int(lens.max())} of {name}"
        )
    return cu.long()


def _check_qkv(q, k, v) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _require(x.dim() == 3, f"{name} must be [tokens, heads, head_dim], got {tuple(x.shape)}")
        _require(x.dtype in HALF, f"{name} must be float16 or bfloat16, got {x.dtype}")
        _require(x.stride(-1) == 1, f"{name} must have a contiguous last dimension (stride {x.stride(-1)})")
        _require(x.device == q.device, f"{name} is on {x.device}, q on {q.device}")
    _require(q.dtype == k.dtype == v.dtype, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _require(k.shape == v.shape, f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _require(
        q.shape[2] == k.shape[2] and q.shape[2] <= 256,
        f"head dims must match and be <= 256, got {q.shape[2]}, {k.shape[2]}",
    )
    _require(
        q.shape[1] % k.shape[1] == 0, f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]}"
    )


def _check_window(window_size) -> tuple[int, int]:
    _require(
        isinstance(window_size, tuple) and len(window_size) == 2 and all(type(w) is int for w in window_size),
        f"window_size must be a (left, right) tuple of ints, got {window_size!r}",
    )
    _require(all(w >= -1 for w in window_size), f"window_size entries are >= 0 or -1 (unbounded), got {window_size}")
    return window_size


def _check_segments(q, k, cu_q, cu_k, max_q, max_k, names: tuple[str, str], window_size) -> tuple:
    """What both attention kernels require of the segments and the window: cu_seqlens (int32 on
    q's device, from 0 to the token counts, max lengths Python ints), as many query as key
    segments, a (left, right) window tuple. Returns (cu_q, cu_k) as int64, and the window."""
    cu_q = _check_cu(cu_q, names[0], q.shape[0], max_q, q.device, torch.int32)
    cu_k = _check_cu(cu_k, names[1], k.shape[0], max_k, q.device, torch.int32)
    _require(cu_q.numel() == cu_k.numel(), f"{names[0]} and {names[1]} must hold the same number of segments")
    return cu_q, cu_k, _check_window(window_size)


def _record(calls: Optional[Calls], window: Optional[tuple[int, int]] = None) -> None:
    if calls is not None:
        calls.n += 1
        if window is not None:
            calls.windows.append(window)


def exact_varlen(q, k, v, cu_q, cu_k, scale: float, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """Per segment: softmax(q k^T * scale) v with flash-attn's mask rules, in float32 (float64 for float64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    left, right = window
    if causal:
        right = 0
    outs = []
    for i in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qi = q[qs:qe].to(acc).transpose(0, 1)  # [H, Lq, D]
        ki, vi = (x[ks:ke].to(acc).repeat_interleave(rep, dim=1).transpose(0, 1) for x in (k, v))
        lq, lk = qe - qs, ke - ks
        pos = torch.arange(lq)[:, None] + (lk - lq)  # bottom-right aligned key position of each query
        key = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if right >= 0:
            allowed &= key <= pos + right
        if left >= 0:
            allowed &= key >= pos - left
        scores = (qi @ ki.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key gets 0 (flash-attn's output)
        outs.append((p @ vi).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


def _segment_scores(q, k, cu_q, cu_k, i, scale, causal, acc):
    """Segment i's [H, Lq, Lk] scores (flash's bottom-right causal mask) and its k rows."""
    rep = q.shape[1] // k.shape[1]
    qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
    qi = q[qs:qe].to(acc).transpose(0, 1)
    ki = k[ks:ke].to(acc).repeat_interleave(rep, dim=1).transpose(0, 1)
    s = (qi @ ki.transpose(-1, -2)) * scale
    if causal:
        lq, lk = qe - qs, ke - ks
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        s = s.masked_fill(~allowed.to(q.device), float("-inf"))
    return s, slice(qs, qe), slice(ks, ke)


def exact_varlen_lse(q, k, v, cu_q, cu_k, scale: float, causal: bool):
    """(out in q's dtype, lse [Hq, Tq] float32): flash's forward, exactly, per segment."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=q.device)
    for i in range(cu_q.numel() - 1):
        s, qs, ks = _segment_scores(q, k, cu_q, cu_k, i, scale, causal, acc)
        if s.shape[1] == 0:
            continue
        vi = v[ks].to(acc).repeat_interleave(rep, dim=1).transpose(0, 1)
        lse[:, qs] = torch.logsumexp(s, -1)
        out[qs] = (torch.softmax(s, -1) @ vi).transpose(0, 1)
    return out.to(q.dtype), lse.float()


def exact_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale: float, causal: bool):
    """flash's backward from the given out and lse (float32 math), per segment: (dq, dk, dv) in q's dtype."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rep = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape[0], q.shape[1], k.shape[2], dtype=acc, device=q.device)
    dv = torch.zeros(v.shape[0], q.shape[1], v.shape[2], dtype=acc, device=q.device)
    for i in range(cu_q.numel() - 1):
        s, qs, ks = _segment_scores(q, k, cu_q, cu_k, i, scale, causal, acc)
        if s.shape[1] == 0:
            continue
        p = torch.exp(s - lse[:, qs].to(acc)[..., None])  # [H, Lq, Lk]
        do = dout[qs].to(acc).transpose(0, 1)
        vi = v[ks].to(acc).repeat_interleave(rep, dim=1).transpose(0, 1)
        ki = k[ks].to(acc).repeat_interleave(rep, dim=1).transpose(0, 1)
        d = (do * out[qs].to(acc).transpose(0, 1)).sum(-1, keepdim=True)
        ds = p * (do @ vi.transpose(-1, -2) - d)
        dq[qs] = (ds @ ki * scale).transpose(0, 1)
        dk[ks] = (ds.transpose(-1, -2) @ q[qs].to(acc).transpose(0, 1) * scale).transpose(0, 1)
        dv[ks] = (p.transpose(-1, -2) @ do).transpose(0, 1)
    fold = lambda x: x.view(x.shape[0], -1, rep, x.shape[-1]).sum(2)  # noqa: E731 - GQA: sum a K/V head's query heads
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


def _check_pair_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, names) -> tuple:
    _check_qkv(q, k, v)
    _require(q.shape[-1] % 8 == 0, f"the private kernel takes head dims that are a multiple of 8, got {q.shape[-1]}")
    _require(type(causal) is bool, f"causal must be a bool, got {type(causal).__name__}")
    _require(isinstance(scale, float), f"the softmax scale must be a float, got {type(scale).__name__}")
    cu_q, cu_k, _ = _check_segments(q, k, cu_q, cu_k, max_q, max_k, names, (-1, -1))
    if causal:
        _require(
            bool(((cu_q[1:] - cu_q[:-1]) <= (cu_k[1:] - cu_k[:-1])).all()),
            "a causal segment has more queries than keys",
        )
    return cu_q, cu_k


def _check_backward_call(dout, q, out, lse) -> None:
    for name, x in (("dout", dout), ("out", out)):
        _require(
            x.shape == q.shape and x.dtype == q.dtype, f"{name} must be like q {tuple(q.shape)}, got {tuple(x.shape)}"
        )
        _require(x.stride(-1) == 1, f"{name} must have a contiguous last dimension")
    _require(
        lse.dtype == torch.float32 and tuple(lse.shape) == (q.shape[1], q.shape[0]),
        f"the lse must be float32 [Hq, Tq] = {(q.shape[1], q.shape[0])}, got {lse.dtype} {tuple(lse.shape)}",
    )


def _flash_attn_varlen_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
    leftpad_k=None,
    seqused_k=None,
    zero_tensors=False,
    *,
    calls: Optional[Calls] = None,
):
    cu_q, cu_k = _check_pair_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        ("cu_seqlens_q", "cu_seqlens_k"),
    )
    _require(
        dropout_p == 0.0 and (window_size_left, window_size_right) == (-1, -1) and softcap == 0.0,
        "the stand-in covers dropout 0, no window, no softcap",
    )
    _require(
        alibi_slopes is None and block_table is None and seqused_k is None and not return_softmax, "plain call only"
    )
    _record(calls)
    out, lse = exact_varlen_lse(q, k, v, cu_q, cu_k, softmax_scale, causal)
    return out, lse, None, torch.zeros(2, dtype=torch.int64)


def _flash_attn_varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
    zero_tensors=False,
):
    cu_q, cu_k = _check_pair_call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        ("cu_seqlens_q", "cu_seqlens_k"),
    )
    _check_backward_call(dout, q, out, softmax_lse)
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _require(buf.shape == like.shape and buf.dtype == like.dtype, f"{name} must be a buffer like its input")
    gq, gk, gv = exact_varlen_backward(dout, q, k, v, out, softmax_lse, cu_q, cu_k, softmax_scale, causal)
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    return torch.zeros_like(softmax_lse)  # softmax_d


class _SchemaOp:
    """A stand-in for an aten op: its arguments bound to the installed torch's own schema of that op."""

    def __init__(self, name: str, fn) -> None:
        self.default = getattr(torch.ops.aten, name).default  # the schema (unavailable() reads it)
        self.fn = fn

    def __call__(self, *args, **kwargs):
        params = self.default._schema.arguments
        bound = {}
        positional = [a for a in params if not a.kwarg_only]
        _require(len(args) <= len(positional), f"{len(args)} positional arguments, the schema has {len(positional)}")
        for a, x in zip(positional, args):
            bound[a.name] = x
        for name, x in kwargs.items():
            _require(any(a.name == name for a in params), f"the schema has no argument {name!r}")
            _require(name not in bound, f"{name!r} given twice")
            bound[name] = x
        missing = [a.name for a in params if a.name not in bound and not a.has_default_value()]
        _require(not missing, f"missing arguments {missing}")
        return self.fn(**bound)


class AtenFlashStandIn:
    """`aten._flash_attention_forward/_backward` on CPU (the torch_varlen pair's ops)."""

    def __init__(self, calls: Calls) -> None:
        self._flash_attention_forward = _SchemaOp("_flash_attention_forward", self._forward)
        self._flash_attention_backward = _SchemaOp("_flash_attention_backward", self._backward)
        self.calls = calls

    def _forward(
        self,
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        scale=None,
        **rest,
    ):
        cu_q, cu_k = _check_pair_call(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, ("cum_seq_q", "cum_seq_k")
        )
        _require(
            dropout_p == 0.0 and not return_debug_mask and all(x is None for x in rest.values()), "plain call only"
        )
        _record(self.calls)
        out, lse = exact_varlen_lse(query, key, value, cu_q, cu_k, scale, is_causal)
        empty = torch.empty(0)
        return out, lse, torch.zeros(2, dtype=torch.uint64), empty, empty

    def _backward(
        self,
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng_state,
        unused,
        scale=None,
        **rest,
    ):
        cu_q, cu_k = _check_pair_call(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale, ("cum_seq_q", "cum_seq_k")
        )
        _check_backward_call(grad_out, query, out, logsumexp)
        _require(dropout_p == 0.0 and all(x is None for x in rest.values()), "plain call only")
        return exact_varlen_backward(grad_out, query, key, value, out, logsumexp, cu_q, cu_k, scale, is_causal)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    calls: Optional[Calls] = None,
):
    _check_qkv(q, k, v)
    cu_q, cu_k, window = _check_segments(
        q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ("cu_seqlens_q", "cu_seqlens_k"), window_size
    )
    _require(
        dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and block_table is None and not return_attn_probs,
        "the stand-in covers dropout 0, no softcap, no alibi, no paged KV, no returned probabilities",
    )
    _record(calls, window)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return exact_varlen(q, k, v, cu_q, cu_k, scale, bool(causal), window)


def varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
    calls: Optional[Calls] = None,
):
    _check_qkv(query, key, value)
    _require(
        enable_gqa or query.shape[1] == key.shape[1], f"Hq={query.shape[1]} != Hkv={key.shape[1]} needs enable_gqa=True"
    )
    cu_q, cu_k, window = _check_segments(
        query, key, cu_seq_q, cu_seq_k, max_q, max_k, ("cu_seq_q", "cu_seq_k"), window_size
    )
    _require(return_aux is None and seqused_k is None and block_table is None, "the stand-in covers the plain call")
    _record(calls, window)
    is_causal = window_size == (-1, 0)  # exactly torch's rule
    s = scale if scale is not None else query.shape[-1] ** -0.5
    return exact_varlen(query, key, value, cu_q, cu_k, s, is_causal, window)


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    head_first=False,
    use_qk_l2norm_in_kernel=False,
    *,
    calls: Optional[Calls] = None,
):
    _require(not head_first, "head_first=True is not the layout transformers passes")
    _require(
        q.dim() == k.dim() == v.dim() == 4 and g.dim() == beta.dim() == 3, "q, k, v [B, T, H, D]; g, beta [B, T, HV]"
    )
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    _require(
        k.shape == q.shape and v.shape[:2] == (b, t) and g.shape == beta.shape == (b, t, hv),
        f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}",
    )
    _require(hv % h == 0, f"value heads {hv} must be a multiple of key heads {h}")
    _require(q.dtype == k.dtype == v.dtype, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require(x.device == q.device, f"{name} is on {x.device}, q on {q.device}")
    if cu_seqlens is None:
        n, bounds = b, None
    else:
        _require(b == 1, f"the batch size must be 1 with cu_seqlens, got {b}")
        cu = _check_cu(cu_seqlens, "cu_seqlens", t, None, q.device, torch.int64)
        n, bounds = cu.numel() - 1, cu.tolist()
    if initial_state is not None:
        _require(
            tuple(initial_state.shape) == (n, hv, dk, dv),
            f"initial_state must be [{n}, {hv}, {dk}, {dv}] (one per sequence), got {tuple(initial_state.shape)}",
        )
        _require(initial_state.device == q.device, "initial_state must be on q's device")
    _record(calls)
    if scale is not None:
        _require(abs(scale - dk**-0.5) < 1e-12, "the stand-in (delta_rule.py) uses scale = K ** -0.5 only")
    outs, states = [], []
    for i in range(n):
        s, e = (bounds[i], bounds[i + 1]) if bounds is not None else (0, t)
        row = slice(0, 1) if bounds is not None else slice(i, i + 1)
        init = initial_state[i : i + 1] if initial_state is not None else None
        o, st = chunk_gated_delta_rule_exact(
            q[row, s:e],
            k[row, s:e],
            v[row, s:e],
            g[row, s:e],
            beta[row, s:e],
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        outs.append(o)
        states.append(st)
    out = torch.cat(outs, dim=1 if bounds is not None else 0)
    final = torch.cat(states) if output_final_state else None
    if final is not None and final.dtype != torch.float64:
        final = final.float()  # fla returns float32 states
    return out, final


# ---------------------------------------------------------------- installing them


def install_flash_attn(monkeypatch, calls: Calls) -> None:
    """A `flash_attn` module with the stand-in, and the backend allowed on CPU."""
    mod = types.ModuleType("flash_attn")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    mod.__path__ = []
    mod.flash_attn_varlen_func = lambda *a, **kw: flash_attn_varlen_func(*a, calls=calls, **kw)
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward = _with_signature(_flash_attn_varlen_forward, (), calls)
    interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    mod.flash_attn_interface = interface
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    _allow_on_cpu(monkeypatch, "flash_attn")


def install_torch_varlen(monkeypatch, calls: Calls, enable_gqa_kwarg: bool = True) -> None:
    """torch.nn.attention.varlen.varlen_attn replaced by the stand-in, with torch 2.13's signature or, with
    enable_gqa_kwarg=False, torch 2.11's (no enable_gqa: then GQA needs K/V expanded to the query heads)."""
    import torch.nn.attention.varlen as varlen

    from zorro_core.attention import backends

    # torch 2.11's varlen_attn ends at window_size: it has none of these keywords
    dropped = () if enable_gqa_kwarg else ("enable_gqa", "seqused_k", "block_table", "num_splits")
    fake = _with_signature(varlen_attn, dropped, calls)
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    # zorro reads the signature to pick the GQA path (cached per process): read the stand-in's
    monkeypatch.setattr(backends, "_varlen_attn_takes", lambda name: name in inspect.signature(fake).parameters)
    from zorro_core.attention.kernels import TorchFlashPair

    monkeypatch.setattr(backends.BACKENDS["torch_varlen"], "pair", TorchFlashPair(ops=AtenFlashStandIn(calls)))
    _allow_on_cpu(monkeypatch, "torch_varlen")


def _with_signature(fn, dropped: tuple[str, ...], calls: Calls):
    """`fn` recording into `calls`, with (and enforcing, as the real function does) fn's
    signature less `calls` and the `dropped` parameters."""
    sig = inspect.signature(fn)
    sig = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in (*dropped, "calls")])

    def fake(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)  # TypeError for an argument this signature lacks
        return fn(*bound.args, **bound.kwargs, calls=calls)

    fake.__signature__ = sig
    return fake


def _allow_on_cpu(monkeypatch, name: str) -> None:
    from zorro_core.attention import backends

    monkeypatch.setattr(backends.BACKENDS[name], "unavailable", lambda device: None)


def install_fla(monkeypatch, calls: Calls) -> None:
    """Qwen3-Next's delta rule resolved to (the stand-in of) fla, and the adapter's fla path taken on CPU."""
    from zorro_core.models import linear_attention

    qwen3_next = sys.modules["transformers.models.qwen3_next.modeling_qwen3_next"]
    monkeypatch.setattr(
        qwen3_next,
        "torch_chunk_gated_delta_rule",
        lambda *a, **kw: chunk_gated_delta_rule(*a, calls=calls, **_fla_kwargs(kw)),
    )
    monkeypatch.setattr(linear_attention, "fla_serves", lambda x: True)


_FLA_PARAMS = {
    "scale",
    "initial_state",
    "output_final_state",
    "cu_seqlens",
    "head_first",
    "use_qk_l2norm_in_kernel",
    "g",
    "beta",
}


def _fla_kwargs(kwargs: dict) -> dict:
    # What transformers' kernel wrapper does: keep the kwargs fla's signature names, drop the rest.
    return {k: v for k, v in kwargs.items() if k in _FLA_PARAMS}
