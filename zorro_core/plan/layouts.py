"""Padded-batch layouts of a plan's attention segments: pure index code, built once per plan.

The CPU-capable attention backends (zorro_core.attention.backends `reference`, `sdpa`) run
segments as a [n, H, L, D] batch. A layout holds what that needs (gather indices, which slots
are real, the bottom-right causal pairs, the masks derived from them); every layer of a forward
reuses the one its Segments built (Segments.padded_layout / Segments.cross_layout).

- PaddedLayout: segment i's queries and keys, each padded to the longest segment.
- CrossLayout: the cross call, where a response's keys are [its group's prompt | itself]. The
  prompt block is gathered once per group and broadcast to the group's responses (the gap
  between a short prompt and the response block is masked).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch


def _slots(cu: torch.Tensor, arange: torch.Tensor, valid: torch.Tensor, total: int) -> torch.Tensor:
    """[n * L] packed row of each padded slot: segment i's own rows, its padding slots pointing at
    its first row. Never a row of another segment: a masked slot still enters the products (a
    probability 0 times its value), and 0 x inf or NaN is NaN, so a padding slot that held another
    row's token would carry that row's non-finite value into this segment."""
    own = cu[:-1, None] + arange[None, :]
    return torch.where(valid, own, cu[:-1, None].clamp(max=max(total - 1, 0))).flatten()


@dataclass
class PaddedLayout:
    """Segments as a padded batch: segment i's queries at [i, :len_q], its keys at [i, :len_k]."""

    n: int
    """Segments (the batch size of the padded batch)."""
    len_q: int
    """Padded query length (the longest query segment)."""
    len_k: int
    """Padded key length (the longest key segment)."""
    uniform_q: bool
    """Every query segment has len_q queries: padding is a view, no gather."""
    uniform_k: bool
    """Every key segment has len_k keys."""
    idx_q: torch.Tensor
    """[n * len_q] row of each padded query slot in the packed queries (padding: the segment's first query)."""
    idx_k: torch.Tensor
    """[n * len_k] row of each padded key slot in the packed keys (padding: the segment's first key)."""
    valid_q: torch.Tensor
    """[n, len_q] real query slots."""
    valid_q_flat: torch.Tensor
    """Flat indices of the real query slots (to drop padding from an output)."""
    q_pos: torch.Tensor
    """[n, len_q] position of each query among its segment's keys (bottom-right alignment)."""
    k_pos: torch.Tensor
    """[n, len_k] position of each key slot."""
    allowed: torch.Tensor
    """[n, len_q, len_k] bool: causal pairs over real keys; a padding query sees key 0 (no NaN)."""
    _masks: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def device(self) -> torch.device:
        return self.idx_q.device

    @classmethod
    def build(
        cls,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int,
        max_k: int,
        total_q: int,
        total_k: int,
        device: torch.device,
    ) -> "PaddedLayout":
        """The layout of segments with cumulative lengths cu_q (queries) and cu_k (keys)."""
        cq, ck = cu_q.to(device).long(), cu_k.to(device).long()
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        n = cq.numel() - 1
        aq = torch.arange(max_q, device=device)
        ak = torch.arange(max_k, device=device)
        valid_q = aq[None, :] < lq[:, None]
        valid_k = ak[None, :] < lk[:, None]
        q_abs = aq[None, :] + (lk - lq)[:, None]  # position of each query among its keys (bottom-right)
        allowed = valid_k[:, None, :] & (ak[None, None, :] <= q_abs[:, :, None])
        # Padding queries would see no key at all (NaN softmax): let them see key 0; their
        # outputs are dropped.
        allowed = allowed | (~valid_q[:, :, None] & (ak[None, None, :] == 0))
        return cls(
            n=n,
            len_q=max_q,
            len_k=max_k,
            uniform_q=total_q == n * max_q,
            uniform_k=total_k == n * max_k,
            idx_q=_slots(cq, aq, valid_q, total_q),
            idx_k=_slots(ck, ak, valid_k, total_k),
            valid_q=valid_q,
            valid_q_flat=valid_q.flatten().nonzero().flatten(),
            q_pos=q_abs,
            k_pos=ak[None, :].expand(n, -1),
            allowed=allowed,
        )

    def mask(self, window: Optional[int], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """[n, 1, Lq, Lk] allowed pairs (bool), or as an additive float mask of `dtype`.

        Built once per (window, dtype): every layer shares one mask tensor instead of saving its
        own converted copy for backward.
        """
        key = (window, dtype)
        if key not in self._masks:
            allowed = self.allowed
            if window is not None:
                near = self.q_pos[:, :, None] - self.k_pos[:, None, :] < window
                allowed = allowed & (near | ~self.valid_q[:, :, None])
            mask = allowed[:, None]
            if dtype is not None:
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._masks[key] = mask
        return self._masks[key]


@dataclass(kw_only=True)
class CrossLayout(PaddedLayout):
    """The cross call: queries padded as in PaddedLayout, keys [prompt block (p_max) | own block (len_q)]."""

    gs: int
    """Groups among the segments (prompt blocks gathered)."""
    p_max: int
    """Padded prompt length (the longest prompt)."""
    prompt_rows: torch.Tensor
    """[gs * p_max] packed row of each prompt-block slot (a short prompt repeats its last token, masked)."""
    uniform_p: bool
    """The prompt blocks are the packed rows [0, gs * p_max) as they are: a view, no gather."""
    local: torch.Tensor
    """[n] prompt block (0..gs-1) of each segment."""

    @classmethod
    def build_cross(
        cls,
        own: PaddedLayout,
        kv_prompt_start: torch.Tensor,
        kv_prompt_len: torch.Tensor,
        kv_group: torch.Tensor,
        lens_q: torch.Tensor,
        device: torch.device,
    ) -> "CrossLayout":
        """The cross layout over `own` (the query segments' PaddedLayout); the kv_* tensors of Segments."""
        n = own.n
        p_start, p_len = kv_prompt_start.to(device), kv_prompt_len.to(device)
        group = kv_group.to(device)
        first = torch.ones(n, dtype=torch.bool, device=device)
        first[1:] = group[1:] != group[:-1]  # segments come grouped, so each group is a run
        local = torch.cumsum(first.long(), 0) - 1
        g_start, g_len = p_start[first], p_len[first]
        ap = torch.arange(int(p_len.max()), device=device)
        block_rows = g_start[:, None] + ap[None, :].clamp(max=g_len[:, None] - 1)
        return cls.from_blocks(own, block_rows, p_len, local, lens_q, device)

    @classmethod
    def from_blocks(
        cls,
        own: PaddedLayout,
        block_rows: torch.Tensor,
        block_len: torch.Tensor,
        local: torch.Tensor,
        lens_q: torch.Tensor,
        device: torch.device,
    ) -> "CrossLayout":
        """The cross layout from its shared key blocks: block_rows [gs, p_max] packed rows of each block
        (a short block repeats its last row, masked), block_len [n] real length of each segment's
        block, local [n] block of each segment. The prompt plan's blocks are prompts; the prefix-tree
        plan's are the parents' paths (zorro_core.plan.trie)."""
        n = own.n
        gs, p_max = block_rows.shape
        prompt_rows = block_rows.flatten()
        uniform_p = bool(torch.equal(prompt_rows, torch.arange(gs * p_max, device=device)))
        lq = lens_q.to(device)
        aq = torch.arange(own.len_q, device=device)
        ap = torch.arange(p_max, device=device)
        q_pos = block_len[:, None] + aq[None, :]
        k_pos = torch.cat([ap[None, :].expand(n, -1), block_len[:, None] + aq[None, :]], 1)
        allowed = torch.cat(
            [
                (ap[None, None, :] < block_len[:, None, None]).expand(n, own.len_q, p_max),
                (aq[None, None, :] <= aq[None, :, None]) & (aq[None, None, :] < lq[:, None, None]),
            ],
            2,
        )
        inherited = {f.name: getattr(own, f.name) for f in fields(PaddedLayout) if f.init}
        inherited.update(q_pos=q_pos, k_pos=k_pos, allowed=allowed)
        return cls(**inherited, gs=gs, p_max=p_max, prompt_rows=prompt_rows, uniform_p=uniform_p, local=local)
