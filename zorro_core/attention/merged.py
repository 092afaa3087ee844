"""Split attention without a copy: kernel calls on slices of the packed row, merged by log-sum-exp.

A response token sees every token of its prompt (no causal mask across that boundary), so the
split path needs no per-response [prompt | own] keys. Over the packed row it runs:
1. one self-causal call over every segment of the row (prompts, lone sequences, and each response
   over itself; for a prefix tree, every node over its own tokens), queries = keys = the row;
2. one call per (query region, ancestor region): the responses of each group, as one query
   segment, against their prompt's keys in place (a trie level d against each level a < d, a
   node's queries as one segment per ancestor). No causal mask: the keys all precede the queries.
The partial outputs merge by their log-sum-exp into the one output of call 1 (written in place):
    lse = logaddexp(lse_1, lse_2),  out = out_1 exp(lse_1 - lse) + out_2 exp(lse_2 - lse).
Backward runs each call's kernel backward with the *merged* output and lse (the rule ring attention
uses: P = exp(S - lse) is then each block's share of the whole softmax, and rowsum(dO * O) is the
whole row's), and sums the gradients. Saved for backward: q, k, v, the output and the lse, what a
single flash-attn call over the packed row saves; nothing gathered, nothing written twice.

The call lists are pure index code built once per plan (its Layouts: zorro_core.attention.layouts). A sliding window that cuts
a prompt (or an ancestor path) cannot be a rectangle of keys: those plans keep the gather path
(`merged_calls` returns None and says why in `merge_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from zorro_core.attention.kernels import KernelPair
from zorro_core.attention.layouts import layouts_of
from zorro_core.plan.prompt import PromptPlan
from zorro_core.plan.protocol import Plan
from zorro_core.plan.segments import cu_seqlens
from zorro_core.plan.trie import TriePlan


@dataclass(frozen=True)
class VarlenCall:
    """One kernel call over slices of the packed row: queries [q0, q1), keys [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int
    cu_q: torch.Tensor
    """[n+1] int32 query offsets within the query slice."""
    cu_k: torch.Tensor
    """[n+1] int32 key offsets within the key slice."""
    max_q: int
    max_k: int
    causal: bool
    """Self-causal segments (queries = keys); otherwise every query sees its segment's keys."""
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    """What a kernel pair derives from the cu_seqlens, kept for every layer of the plan."""


def _call(q0, q1, k0, k1, lens_q: torch.Tensor, lens_k: torch.Tensor, causal: bool) -> VarlenCall:
    mq, mk = (int(x) for x in torch.stack([lens_q.max(), lens_k.max()]).tolist())
    return VarlenCall(q0, q1, k0, k1, cu_seqlens(lens_q), cu_seqlens(lens_k), mq, mk, causal)


def _prompt_calls(plan: PromptPlan) -> list[VarlenCall]:
    t = plan.num_tokens
    causal = plan.causal
    if plan.cross is None:
        return [_call(0, t, 0, t, causal.lens_q, causal.lens_k, True)]
    cross, tc = plan.cross, causal.total_q
    own = torch.cat([causal.lens_q, cross.lens_q])
    calls = [_call(0, t, 0, t, own, own, True)]
    # The responses of group g (adjacent, groups in the order of their causal segments) as one
    # query segment against causal segment g; a lone group's segment gets no queries.
    if cross.kv_group is None:
        raise ValueError("cross segments without their groups (kv_group)")
    per_group = torch.zeros(causal.num_segments, dtype=torch.long, device=own.device)
    per_group.index_add_(0, cross.kv_group.to(own.device), cross.lens_q)
    calls.append(_call(tc, t, 0, tc, per_group, causal.lens_k, False))
    return calls


def _trie_calls(plan: TriePlan) -> list[VarlenCall]:
    t = plan.num_tokens
    levels = plan.levels
    own = torch.cat([lv.seg.lens_q for lv in levels])
    calls = [_call(0, t, 0, t, own, own, True)]
    first = [0]  # node id of each level's first node (nodes are numbered in packed order)
    for lv in levels:
        first.append(first[-1] + lv.seg.num_segments)
    parent = plan.node_parent.to(own.device)
    for d in range(1, len(levels)):
        seg_d = levels[d].seg
        anc = torch.arange(first[d], first[d + 1], device=own.device)
        for a in range(d - 1, -1, -1):
            anc = parent[anc]  # each level-d node's ancestor on level a
            seg_a = levels[a].seg
            counts = torch.zeros(seg_a.num_segments, dtype=torch.long, device=own.device)
            counts.index_add_(0, anc - first[a], seg_d.lens_q.to(own.device))
            calls.append(
                _call(
                    seg_d.q_start,
                    seg_d.q_start + seg_d.total_q,
                    seg_a.q_start,
                    seg_a.q_start + seg_a.total_q,
                    counts,
                    seg_a.lens_q,
                    False,
                )
            )
    return calls


def _ordered(plan: Plan) -> bool:
    """The layout the calls rely on: each query region's nodes in the order of their ancestors."""
    if not isinstance(plan, TriePlan):
        return True
    first, parent = 0, plan.node_parent
    bounds = []
    for lv in plan.levels:
        bounds.append((first, first + lv.seg.num_segments))
        first += lv.seg.num_segments
    for d in range(1, len(bounds)):
        par = parent[bounds[d][0] : bounds[d][1]]
        if bool((par[1:] < par[:-1]).any()):
            return False
    return True


def merge_refusal(plan: Plan, window: Optional[int]) -> Optional[str]:
    """Why `plan`'s split attention cannot run gather-free with `window`, or None. A plan with
    nothing shared is one self-causal call either way: "" (no reason to say) when windowed.
    Decided once per plan and window (every layer asks; the trie's check reads its parents)."""
    if not isinstance(plan, (PromptPlan, TriePlan)):
        return f"no gather-free calls for a {type(plan).__name__}"
    return layouts_of(plan).get(("merge_refusal", window), lambda: _refusal(plan, window))


def _refusal(plan: Plan, window: Optional[int]) -> Optional[str]:
    if not isinstance(plan, (PromptPlan, TriePlan)):
        return f"no gather-free calls for a {type(plan).__name__}"
    if window is not None and window < longest_path(plan):
        if isinstance(plan, PromptPlan) and plan.cross is None:
            return ""
        return f"the sliding window ({window}) cuts a prompt: its keys are not a block of the packed row"
    if not _ordered(plan):
        return "the trie's levels are not grouped by ancestor"
    return None


def longest_path(plan: Plan) -> int:
    """Tokens of the longest path through the plan (a prompt + response; a trie row)."""
    return layouts_of(plan).get(("longest_path",), lambda: int(plan.position_ids.max()) + 1)


def merged_calls(plan: Plan) -> list[VarlenCall]:
    """The plan's gather-free kernel calls (module docstring), built once per plan."""
    build = _trie_calls if isinstance(plan, TriePlan) else _prompt_calls
    return layouts_of(plan).get(("merged_calls",), lambda: build(plan))  # type: ignore[arg-type]


_INF = float("inf")


def _keyless_as_inf(lse: torch.Tensor) -> torch.Tensor:
    """A row that saw no key has lse +inf (flash's convention: the backward's exp(S - lse) is then 0
    there, where -inf, which torch's CPU kernel and a bare logsumexp give, would make it inf)."""
    return lse.masked_fill_(lse == -_INF, _INF)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out, lse (a slice of the row's) <- their log-sum-exp merge with a partial's, in place.
    A side that saw no key (lse +inf or -inf) weighs 0; a row neither saw a key for gets output 0
    and lse +inf (as one flash call would), never NaN."""
    a = lse.masked_fill(lse == _INF, -_INF)
    b = part_lse.masked_fill(part_lse == _INF, -_INF)
    new = torch.logaddexp(a, b)
    keyless = new == -_INF
    ref = new.masked_fill(keyless, 0.0)  # finite: exp(-inf - 0) = 0 on both sides of a key-less row
    w_old = torch.exp(a - ref).T[..., None]  # [Tq, H, 1]
    w_new = torch.exp(b - ref).T[..., None]
    acc = w_old.dtype
    out.copy_(out.to(acc) * w_old + part.to(acc) * w_new)
    lse.copy_(new.masked_fill(keyless, _INF))


class MergedSplitAttention(torch.autograd.Function):
    """The calls of `merged_calls` through a kernel pair: q [T, Hq, D], k, v [T, Hkv, D*] -> [T, Hq, Dv]."""

    @staticmethod
    def forward(ctx, q, k, v, calls: list[VarlenCall], pair: KernelPair, scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _forward(pair, calls[0], q, k, v, scale)  # the whole row: [0, T) for queries and keys
        _keyless_as_inf(lse)
        for c in calls[1:]:
            o, s = _forward(pair, c, q, k, v, scale)
            _merge_into(out[c.q0 : c.q1], lse[:, c.q0 : c.q1], o, s)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.pair, ctx.scale = calls, pair, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = _backward(ctx.pair, ctx.calls[0], dout, q, k, v, out, lse, ctx.scale)
        if len(ctx.calls) == 1:
            return dq, dk, dv, None, None, None
        # Summed in float32 (float64 for float64) and rounded once, as one kernel call's
        # accumulators are: a bf16 sum would round once per call.
        acc = lse.dtype
        dq, dk, dv = dq.to(acc), dk.to(acc), dv.to(acc)
        for c in ctx.calls[1:]:
            gq, gk, gv = _backward(ctx.pair, c, dout, q, k, v, out, lse, ctx.scale)
            dq[c.q0 : c.q1] += gq
            dk[c.k0 : c.k1] += gk
            dv[c.k0 : c.k1] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _forward(pair: KernelPair, c: VarlenCall, q, k, v, scale: float):
    """The pair's forward of call `c` on its slices of the row."""
    ks = slice(c.k0, c.k1)
    return pair.forward(q[c.q0 : c.q1], k[ks], v[ks], c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, scale, c.cache)


def _backward(pair: KernelPair, c: VarlenCall, dout, q, k, v, out, lse, scale: float):
    """The pair's backward of call `c`, handed the merged output and lse of its queries. The lse
    columns of a later call are copied into a dense [Hq, Tq_c] block: the CUDA kernels read it from
    its data pointer, strides ignored (a column slice would give every head but the first another
    head's rows)."""
    qs, ks = slice(c.q0, c.q1), slice(c.k0, c.k1)
    lse_c = lse[:, qs].contiguous()
    return pair.backward(
        dout[qs], q[qs], k[ks], v[ks], out[qs], lse_c, c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal, scale, c.cache
    )


def merged_split_attention(plan: Plan, q, k, v, scale: float, pair: KernelPair) -> torch.Tensor:
    """Split mode over the packed row with no gathered keys (merge_refusal(plan, window) is None)."""
    return MergedSplitAttention.apply(q, k, v, merged_calls(plan), pair, scale)
