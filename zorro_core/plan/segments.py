"""Segments of one varlen attention call over the packed row, and the index helpers both plans use.

Shared by the prompt plan (zorro_core.plan.prompt) and the prefix-tree plan (zorro_core.plan.trie).
How attention's kernels see them (padded layouts, gathers) is attention's: zorro_core.attention.layouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Segments:
    """The segments of one varlen attention call over the packed row."""

    q_start: int
    """The queries are packed positions [q_start, q_start + Tq), segment after segment."""
    k_index: torch.Tensor
    """[Tk] packed positions of the keys/values, segment after segment."""
    cu_q: torch.Tensor
    """[n+1] int32 cumulative query lengths."""
    cu_k: torch.Tensor
    """[n+1] int32 cumulative key lengths."""
    max_q: int
    """Longest query segment."""
    max_k: int
    """Longest key segment."""
    q_is_k: bool
    """Queries and keys are the same tokens (self-causal segments)."""
    total_q: int
    """Tq, all queries."""
    total_k: int
    """Tk, all keys."""
    kv_prompt_start: Optional[torch.Tensor] = None
    """Cross call only: [n] packed position of each segment's prompt (its keys start there)."""
    kv_prompt_len: Optional[torch.Tensor] = None
    """Cross call only: [n] length of each segment's prompt."""
    kv_group: Optional[torch.Tensor] = None
    """Cross call only: [n] group of each segment (segments of a group are adjacent)."""

    @property
    def q_index(self) -> torch.Tensor:
        return torch.arange(self.q_start, self.q_start + self.total_q, device=self.cu_q.device)

    @property
    def num_segments(self) -> int:
        return self.cu_q.numel() - 1

    @property
    def lens_q(self) -> torch.Tensor:
        return (self.cu_q[1:] - self.cu_q[:-1]).long()

    @property
    def lens_k(self) -> torch.Tensor:
        return (self.cu_k[1:] - self.cu_k[:-1]).long()

    def attended_pairs(self) -> int:
        """Query-key pairs of the call: each segment causal over its keys, aligned bottom-right."""
        q, k = self.lens_q, self.lens_k
        return int((q * (k - q) + q * (q + 1) // 2).sum())


def concat_ranges(starts: torch.Tensor, lens: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    if total == 0:
        return starts.new_zeros(0)
    seg_begin = torch.cumsum(lens, 0) - lens
    within = torch.arange(total, device=starts.device) - torch.repeat_interleave(seg_begin, lens, output_size=total)
    return torch.repeat_interleave(starts, lens, output_size=total) + within


def cu_seqlens(lens: torch.Tensor) -> torch.Tensor:
    """[n+1] int32 cumulative lengths from 0: the `cu_seqlens` of varlen attention kernels."""
    return torch.nn.functional.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)
