"""Attention over a prefix-tree plan (zorro_core.plan.trie): split mode per level, and flex masks.

Split mode, one call per level of the tree (nodes of a level are contiguous in the packed row):
- level 0, the roots: self-causal segments through the varlen backend, as `sharing="prompt"`'s
  causal call;
- level d >= 1: the queries are the level's nodes; a node's keys are its ancestors' tokens (the
  path from its root to its parent, in path order) followed by its own, causal aligned
  bottom-right. This is `sharing="prompt"`'s cross call with "prompt" generalised to "the
  parent's path", run by the backend's `tree_level` (zorro_core.attention.backends). The padded
  (CPU) backends reuse the cross call's machinery (zorro_core.attention.padded): the parent's
  path is gathered once per distinct parent and broadcast to its children, and the CPU flash
  path saves no copy of it for backward. flash-attn / torch varlen (GPU) take one gather of
  [path | own] per node (`Layouts.level_k_index`). Every layout is the plan's, built once
  (zorro_core.attention.layouts).
Windows are by path position (both calls and masks use positions along the path), which is the
baseline's rule since a row's positions are its path's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from zorro_core.attention.backends import BACKENDS
from zorro_core.attention.flex import BLOCK
from zorro_core.attention.layouts import layouts_of
from zorro_core.attention.merged import merged_split_attention
from zorro_core.plan.trie import TriePlan


def tree_split_attention(plan: TriePlan, q, k, v, scale: float, window: Optional[int], backend: str) -> torch.Tensor:
    """Split mode over a trie's packed row: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    be = BACKENDS[backend]
    if be.pair is not None and be.gather_free(plan, q, window):
        return merged_split_attention(plan, q, k, v, scale, be.pair)
    layouts = layouts_of(plan)
    roots = plan.levels[0].seg
    t0 = roots.total_q
    outs = [be.causal(q[:t0], k[:t0], v[:t0], roots, scale, window, layouts)]
    for level in plan.levels[1:]:
        seg = level.seg
        outs.append(be.tree_level(q[seg.q_start : seg.q_start + seg.total_q], k, v, level, scale, window, layouts))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def tree_block_mask(plan: TriePlan, window: Optional[int] = None):
    """The tree mask as a FlexAttention BlockMask (packed length padded to a multiple of 128):
    q sees k iff k's node is an ancestor-or-self of q's and k <= q (and within the window)."""
    # lazy: FlexAttention is heavy and loads only when a tree block mask is built
    from torch.nn.attention.flex_attention import create_block_mask

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
