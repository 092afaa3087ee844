"""The trie's split-mode attention calls, one per level: what each level's nodes attend to.

A level's nodes are contiguous in the packed row. Level 0 (the roots) is self-causal segments;
at level d >= 1 a node's keys are its ancestors' tokens (the path from its root to its parent)
followed by its own, causal aligned bottom-right. How the kernels see a level (its padded layout,
its gather) is attention's: zorro_core.attention.layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from zorro_core.plan.segments import Segments, cu_seqlens
from zorro_core.plan.trie_pack import _Nodes


@dataclass
class TreeLevel:
    """One attention call of split mode: the nodes of one level (contiguous in the packed row)."""

    seg: Segments
    """Queries = the level's nodes; keys = each node's ancestors then itself (level 0: itself)."""
    prefix_rows: Optional[torch.Tensor] = None
    """Levels >= 1: [gs, p_max] packed positions of the path of each distinct parent (the keys all
    its children share), clamped at the path's last token; None at level 0."""
    prefix_len: Optional[torch.Tensor] = None
    """Levels >= 1: [n] tokens of each node's ancestors (its depth)."""
    local: Optional[torch.Tensor] = None
    """Levels >= 1: [n] row of prefix_rows each node hangs from (nodes of one parent are adjacent)."""

    def path(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Levels >= 1: (prefix_rows, prefix_len, local); level 0 has no ancestors' path."""
        if self.prefix_rows is None or self.prefix_len is None or self.local is None:
            raise ValueError("level 0 (the roots) has no ancestors' path")
        return self.prefix_rows, self.prefix_len, self.local


def _levels_on(levels: list[TreeLevel], dev: torch.device) -> list[TreeLevel]:
    """The levels (built on the host) with their index tensors moved to the batch's device."""
    to = lambda x: x.to(dev)  # noqa: E731
    for lv in levels:
        lv.seg = Segments(
            lv.seg.q_start,
            to(lv.seg.k_index),
            to(lv.seg.cu_q),
            to(lv.seg.cu_k),
            lv.seg.max_q,
            lv.seg.max_k,
            lv.seg.q_is_k,
            lv.seg.total_q,
            lv.seg.total_k,
        )
        if lv.prefix_rows is not None:
            lv.prefix_rows, lv.prefix_len, lv.local = to(lv.prefix_rows), to(lv.prefix_len), to(lv.local)
    return levels


def _levels(
    by_level: list[list[int]], numbered: _Nodes, packed_at: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[TreeLevel]:
    """One TreeLevel per level of the tree (host tensors)."""
    new, depth, nlen, nstart = numbered.new, numbered.depth, numbered.length, numbered.start
    par, rep = numbered.parent, numbered.rep
    levels = []
    for i, nodes in enumerate(by_level):
        ids = torch.tensor([new[n] for n in nodes], dtype=torch.long)
        lq = nlen[ids]
        q0, tq, mq = int(nstart[ids[0]]), int(lq.sum()), int(lq.max())
        if i == 0:
            seg = Segments(q0, torch.arange(q0, q0 + tq), cu_seqlens(lq), cu_seqlens(lq), mq, mq, True, tq, tq)
            levels.append(TreeLevel(seg))
            continue
        plen = depth[ids]
        lk = plen + lq
        p = par[ids]
        first = torch.ones(len(nodes), dtype=torch.bool)
        first[1:] = p[1:] != p[:-1]  # nodes of one parent are adjacent
        local = torch.cumsum(first.long(), 0) - 1
        g_len = plen[first]
        p_max = int(g_len.max())
        d = torch.arange(p_max)[None, :].clamp(max=g_len[:, None] - 1)
        prefix_rows = packed_at(rep[ids[first]], d)
        # k_index (the gather that flash/torch varlen take) is built on demand by zorro_core.attention.tree.
        seg = Segments(
            q0,
            torch.zeros(0, dtype=torch.long),
            cu_seqlens(lq),
            cu_seqlens(lk),
            mq,
            int(lk.max()),
            False,
            tq,
            int(lk.sum()),
        )
        levels.append(TreeLevel(seg, prefix_rows, plen, local))
    return levels
