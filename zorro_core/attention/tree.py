"""Attention over a prefix-tree plan (zorro_core.core.trie): split mode per level, and flex masks.

Split mode, one call per level of the tree (nodes of a level are contiguous in the packed row):
- level 0, the roots: self-causal segments through the varlen backend, as `sharing="prompt"`'s
  causal call;
- level d >= 1: the queries are the level's nodes; a node's keys are its ancestors' tokens (the
  path from its root to its parent, in path order) followed by its own, causal aligned
  bottom-right. This is `sharing="prompt"`'s cross call with "prompt" generalised to "the
  parent's path", so the CPU backends reuse its machinery (zorro_core.attention.padded): the
  parent's path is gathered once per distinct parent and broadcast to its children, and the CPU
  flash path saves no copy of it for backward. flash-attn / torch varlen (GPU) take one gather of
  [path | own] per node (`level_k_index`).
Windows are by path position (both calls and masks use positions along the path), which is the
baseline's rule since a row's positions are its path's.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from zorro_core.attention.backends import BACKENDS, PADDED
from zorro_core.attention.padded import _cross_blocks, _FlashCross, attend, from_padded, padded_mask, self_layout
from zorro_core.core.trie import TreeLevel, TriePlan


def level_layout(level: TreeLevel, device: torch.device) -> dict:
    """The padded layout of a level >= 1, in the shape zorro_core.attention.padded's cross call uses:
    [parent path block | own block] keys per node; cached on the level."""
    key = ("tree", str(device))
    if key in level.cache:
        return level.cache[key]
    seg = level.seg
    own = self_layout(seg, device)
    n = own["n"]
    p_len, local, rows = level.prefix_len.to(device), level.local.to(device), level.prefix_rows.to(device)
    gs, p_max = rows.shape
    prompt_rows = rows.flatten()
    uniform_p = bool(torch.equal(prompt_rows, torch.arange(gs * p_max, device=device)))
    lq = seg.lens_q.to(device)
    aq = torch.arange(seg.max_q, device=device)
    ap = torch.arange(p_max, device=device)
    q_pos = p_len[:, None] + aq[None, :]
    k_pos = torch.cat([ap[None, :].expand(n, -1), p_len[:, None] + aq[None, :]], 1)
    allowed = torch.cat([
        (ap[None, None, :] < p_len[:, None, None]).expand(n, seg.max_q, p_max),
        (aq[None, None, :] <= aq[None, :, None]) & (aq[None, None, :] < lq[:, None, None]),
    ], 2)
    lay = dict(own, gs=gs, p_max=p_max, prompt_rows=prompt_rows, uniform_p=uniform_p, local=local,
               q_pos=q_pos, k_pos=k_pos, allowed=allowed)
    if not uniform_p:  # the compact view: keys gathered as [paths | own], paths first and contiguous
        compact = dataclasses.replace(seg, q_start=gs * p_max, cache=seg.cache)
        level.cache[("compact", str(device))] = (compact, dict(
            lay, prompt_rows=torch.arange(gs * p_max, device=device), uniform_p=True))
        lay["path_rows"] = prompt_rows
    level.cache[key] = lay
    return lay


def level_k_index(level: TreeLevel, device: torch.device) -> torch.Tensor:
    """[Tk] packed positions of each node's keys ([parent path | own], node after node); cached."""
    key = ("k_index", str(device))
    if key not in level.cache:
        seg = level.seg
        p_len, local, rows = level.prefix_len.to(device), level.local.to(device), level.prefix_rows.to(device)
        lq = seg.lens_q.to(device)
        aq = torch.arange(seg.max_q, device=device)
        ap = torch.arange(rows.shape[1], device=device)
        own = seg.q_start + seg.cu_q[:-1].to(device).long()[:, None] + aq[None, :]
        idx = torch.cat([rows[local], own], 1)
        valid = torch.cat([ap[None, :] < p_len[:, None], aq[None, :] < lq[:, None]], 1)
        level.cache[key] = idx[valid]
    return level.cache[key]


def tree_split_attention(plan: TriePlan, q, k, v, scale: float, window: Optional[int], backend: str) -> torch.Tensor:
    """Split mode over a trie's packed row: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    fn = BACKENDS[backend]
    roots = plan.levels[0].seg
    t0 = roots.total_q
    outs = [fn(q[:t0], k[:t0], v[:t0], roots, scale, window)]
    for level in plan.levels[1:]:
        seg = level.seg
        qx = q[seg.q_start: seg.q_start + seg.total_q]
        if backend not in PADDED:
            idx = level_k_index(level, q.device)
            outs.append(fn(qx, k[idx], v[idx], seg, scale, window))
            continue
        lay = level_layout(level, q.device)
        kl, vl = k, v
        if not lay["uniform_p"]:
            # The parents' paths are scattered over the packed row (root, then inner nodes): gather
            # them once per call into [paths | the level's own keys], so that the padded machinery
            # reads a contiguous block instead of gathering the paths again for every chunk.
            rows = torch.cat([lay["path_rows"], seg.q_start + torch.arange(seg.total_q, device=q.device)])
            kl, vl = k[rows], v[rows]
            seg, lay = level.cache[("compact", str(q.device))]
        if backend != "reference" and q.device.type == "cpu":
            outs.append(_FlashCross.apply(qx, kl, vl, seg, lay, scale, padded_mask(lay, window, q.dtype)))
        else:
            qp, kp, vp = _cross_blocks(qx, kl, vl, seg, lay)
            outs.append(from_padded(attend(qp, kp, vp, lay, window, scale, backend == "reference"), lay))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def tree_block_mask(plan: TriePlan, window: Optional[int] = None):
    """The tree mask as a FlexAttention BlockMask (packed length padded to a multiple of 128):
    q sees k iff k's node is an ancestor-or-self of q's and k <= q (and within the window)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from zorro_core.attention.flex import BLOCK

    t, m = plan.num_tokens, plan.num_nodes
    padded = -(-t // BLOCK) * BLOCK
    pad = padded - t
    # Padding tokens form their own node (tin = M), seen by no real token and seeing only padding.
    node = F.pad(plan.token_node, (0, pad), value=m)
    tin = F.pad(plan.node_tin, (0, 1), value=m)
    tout = F.pad(plan.node_tout, (0, 1), value=m + 1)
    pos = F.pad(plan.position_ids, (0, pad), value=0)

    def mask_mod(b, h, q, kv):
        tq = tin[node[q]]
        allowed = (tin[node[kv]] <= tq) & (tq < tout[node[kv]]) & (kv <= q)
        if window is not None:
            allowed = allowed & (pos[q] - pos[kv] < window)
        return allowed

    return create_block_mask(mask_mod, 1, None, padded, padded, device=plan.device)
