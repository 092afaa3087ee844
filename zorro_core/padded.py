"""Padded-batch layouts for the CPU-capable attention backends (`reference`, `sdpa`).

Segments become a [n, H, L, D] batch: a view when every segment has the same length, one
gather otherwise. Layouts (indices, masks) are built once per plan and cached on the
Segments, then reused by every layer.

The cross call has its own layout: a response's keys are [its group's prompt | itself]. The
prompt block is gathered once per group and broadcast to the group's responses along the
batch dimension, instead of one row gather per (response, prompt token): on CPU the
backward of a row gather with duplicates (index_add / scatter_add) is slow, the backward of
a broadcast is a plain sum. The gap between a short prompt and the response block is masked.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .plan import Segments


def self_layout(seg: Segments, device: torch.device) -> dict:
    """Gather indices of `seg` as a padded batch and its bottom-right causal mask; cached on seg."""
    key = ("padded", str(device))
    if key in seg.cache:
        return seg.cache[key]
    lq, lk = seg.lens_q.to(device), seg.lens_k.to(device)
    cq, ck = seg.cu_q.to(device).long(), seg.cu_k.to(device).long()
    n = seg.num_segments
    aq = torch.arange(seg.max_q, device=device)
    ak = torch.arange(seg.max_k, device=device)
    valid_q = aq[None, :] < lq[:, None]
    valid_k = ak[None, :] < lk[:, None]
    q_abs = aq[None, :] + (lk - lq)[:, None]  # position of each query among its keys (bottom-right)
    allowed = valid_k[:, None, :] & (ak[None, None, :] <= q_abs[:, :, None])
    # Padding queries would see no key at all (NaN softmax): let them see key 0; their
    # outputs are dropped.
    allowed = allowed | (~valid_q[:, :, None] & (ak[None, None, :] == 0))
    lay = {
        "n": n, "len_q": seg.max_q, "len_k": seg.max_k,
        "uniform_q": seg.total_q == n * seg.max_q,
        "uniform_k": seg.total_k == n * seg.max_k,
        "idx_q": torch.where(valid_q, cq[:-1, None] + aq[None, :], 0).flatten(),
        "idx_k": torch.where(valid_k, ck[:-1, None] + ak[None, :], 0).flatten(),
        "valid_q": valid_q,
        "valid_q_flat": valid_q.flatten().nonzero().flatten(),
        "q_pos": q_abs,
        "k_pos": ak[None, :].expand(n, -1),
        "allowed": allowed,
    }
    seg.cache[key] = lay
    return lay


def padded_mask(lay: dict, window: Optional[int]) -> torch.Tensor:
    """[n, 1, Lq, Lk] allowed pairs, with the sliding window (by position) when set."""
    allowed = lay["allowed"]
    if window is not None:
        near = lay["q_pos"][:, :, None] - lay["k_pos"][:, None, :] < window
        allowed = allowed & (near | ~lay["valid_q"][:, :, None])
    return allowed[:, None]


def pad(x: torch.Tensor, idx: torch.Tensor, uniform: bool, n: int, length: int) -> torch.Tensor:
    """[T, H, D] -> [n, H, L, D]."""
    x = x if uniform else x[idx]
    return x.view(n, length, *x.shape[1:]).transpose(1, 2)


def to_padded(q, k, v, seg: Segments):
    lay = self_layout(seg, q.device)
    n = lay["n"]
    qp = pad(q, lay["idx_q"], lay["uniform_q"], n, seg.max_q)
    kp = pad(k, lay["idx_k"], lay["uniform_k"], n, seg.max_k)
    vp = pad(v, lay["idx_k"], lay["uniform_k"], n, seg.max_k)
    return lay, qp, kp, vp


def from_padded(out_p: torch.Tensor, lay: dict) -> torch.Tensor:
    """[n, H, L, D] -> [T, H, D], padding queries dropped."""
    n, h, length, d = out_p.shape
    out = out_p.transpose(1, 2).reshape(n * length, h, d)
    return out if lay["uniform_q"] else out[lay["valid_q_flat"]]


def attend(qp, kp, vp, mask: Optional[torch.Tensor], scale: float, exact: bool) -> torch.Tensor:
    """softmax(QK^T * scale + mask) V over a padded batch; mask None means top-left causal.

    exact: explicit scores with softmax in float32 (float64 for float64 inputs), the
    reference; otherwise F.scaled_dot_product_attention.
    """
    if not exact:
        if mask is None:
            return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=qp.shape[1] != kp.shape[1])
        return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=qp.shape[1] != kp.shape[1])
    rep = qp.shape[1] // kp.shape[1]
    kp, vp = kp.repeat_interleave(rep, dim=1), vp.repeat_interleave(rep, dim=1)
    acc = torch.float64 if qp.dtype == torch.float64 else torch.float32
    scores = torch.matmul(qp.to(acc), kp.to(acc).transpose(-1, -2)) * scale
    if mask is None:
        lq, lk = scores.shape[-2:]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vp.to(acc)).to(qp.dtype)


def cross_layout(seg: Segments, device: torch.device) -> dict:
    """Layout of the cross call: [prompt block | own block] keys per response; cached on seg."""
    key = ("cross", str(device))
    if key in seg.cache:
        return seg.cache[key]
    own = self_layout(seg, device)  # queries (and own keys) are padded like the query segments
    n = own["n"]
    p_start, p_len = seg.kv_prompt_start.to(device), seg.kv_prompt_len.to(device)
    group = seg.kv_group.to(device)
    first = torch.ones(n, dtype=torch.bool, device=device)
    first[1:] = group[1:] != group[:-1]  # segments come grouped, so each group is a run
    local = torch.cumsum(first.long(), 0) - 1
    g_start, g_len = p_start[first], p_len[first]
    gs, p_max = int(first.sum()), int(p_len.max())
    ap = torch.arange(p_max, device=device)
    prompt_rows = (g_start[:, None] + ap[None, :].clamp(max=g_len[:, None] - 1)).flatten()
    uniform_p = bool(torch.equal(prompt_rows, torch.arange(gs * p_max, device=device)))
    lq = seg.lens_q.to(device)
    aq = torch.arange(seg.max_q, device=device)
    ar = aq
    q_pos = p_len[:, None] + aq[None, :]
    k_pos = torch.cat([ap[None, :].expand(n, -1), p_len[:, None] + ar[None, :]], 1)
    allowed = torch.cat([
        (ap[None, None, :] < p_len[:, None, None]).expand(n, seg.max_q, p_max),
        (ar[None, None, :] <= aq[None, :, None]) & (ar[None, None, :] < lq[:, None, None]),
    ], 2)
    lay = dict(own, gs=gs, p_max=p_max, prompt_rows=prompt_rows, uniform_p=uniform_p, local=local,
               q_pos=q_pos, k_pos=k_pos, allowed=allowed)
    seg.cache[key] = lay
    return lay


def cross_attention(q, k, v, seg: Segments, scale: float, window: Optional[int], exact: bool) -> torch.Tensor:
    """Responses of shared groups against [their prompt | themselves].

    q [Tq, Hq, D] holds the responses' queries (seg's query segments); k, v [T, Hkv, D] are
    the whole packed row's keys/values, with the responses' own at seg.q_start onwards.
    """
    lay = cross_layout(seg, q.device)
    n, tq = lay["n"], seg.total_q
    blocks = []
    for x in (k, v):
        rows = x[: lay["gs"] * lay["p_max"]] if lay["uniform_p"] else x[lay["prompt_rows"]]
        prompt = rows.view(lay["gs"], lay["p_max"], *x.shape[1:])
        prompt = prompt.expand(n, *prompt.shape[1:]) if lay["gs"] == 1 else prompt[lay["local"]]
        own = x[seg.q_start: seg.q_start + tq]
        own = own if lay["uniform_q"] else own[lay["idx_q"]]
        own = own.view(n, seg.max_q, *x.shape[1:])
        blocks.append(torch.cat([prompt, own], 1).transpose(1, 2))
    qp = pad(q, lay["idx_q"], lay["uniform_q"], n, seg.max_q)
    out = attend(qp, blocks[0], blocks[1], padded_mask(lay, window), scale, exact)
    return from_padded(out, lay)
