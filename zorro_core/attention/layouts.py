"""How attention's kernels see a plan: padded-batch layouts and gathers, built once per plan.

The plan says what is computed (its segments, a trie's levels); this module derives, from those
alone, the index code the backends run it with, and keeps it in one place per plan: `Layouts`,
stored in the plan's opaque per-plan cache (`plan.derived`) by `layouts_of(plan)` and reused by
every layer of every forward and backward over that plan.

- PaddedLayout: segment i's queries and keys, each padded to the longest segment (the CPU-capable
  backends `reference` and `sdpa` run segments as a [n, H, L, D] batch).
- CrossLayout: the cross call, where a response's keys are [its group's prompt | itself]. The
  prompt block is gathered once per group and broadcast to the group's responses (the gap
  between a short prompt and the response block is masked). A trie level is the same call with
  "prompt" generalised to "the parent's path".
- A trie level's compact key row and its [path | own] gather (`Layouts.level_compact`,
  `Layouts.level_k_index`).
The gather-free split path's calls (zorro_core.attention.merged) are kept in the same `Layouts`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

import torch

from zorro_core.plan.protocol import Plan
from zorro_core.plan.segments import Segments
from zorro_core.plan.trie_levels import TreeLevel


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
        plan's are the parents' paths (zorro_core.plan.trie_levels)."""
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


class Layouts:
    """Everything attention derives from one plan: each layout built on first use for a device,
    then the same object for every layer (and its backward). One per plan (`layouts_of`); a
    Layouts of its own (no reuse) serves a call on bare segments."""

    def __init__(self) -> None:
        self._built: dict[tuple, Any] = {}
        self._held: dict[int, object] = {}
        """The segments and levels keyed by id(): held, so that no other object takes their id."""

    def _key(self, kind: str, part: object, device: torch.device | str) -> tuple:
        self._held[id(part)] = part
        return (kind, id(part), torch.device(device))

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        """`build()` on the first call for `key`, the same object afterwards."""
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def padded(self, seg: Segments, device: torch.device | str) -> PaddedLayout:
        """The segments as a padded batch."""
        dev = torch.device(device)
        return self.get(
            self._key("padded", seg, dev),
            lambda: PaddedLayout.build(seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, seg.total_q, seg.total_k, dev),
        )

    def cross(self, seg: Segments, device: torch.device | str) -> CrossLayout:
        """Cross segments only: [prompt block | own block] keys per segment."""
        if seg.kv_group is None or seg.kv_prompt_start is None or seg.kv_prompt_len is None:
            raise ValueError("a cross layout needs cross segments (kv_prompt_start, kv_prompt_len, kv_group)")
        dev = torch.device(device)
        start, plen, group = seg.kv_prompt_start, seg.kv_prompt_len, seg.kv_group
        return self.get(
            self._key("cross", seg, dev),
            lambda: CrossLayout.build_cross(self.padded(seg, dev), start, plen, group, seg.lens_q, dev),
        )

    def level_cross(self, level: TreeLevel, device: torch.device | str) -> CrossLayout:
        """A trie level >= 1: the padded layout of [parent path block | own block] keys per node, the
        prompt plan's cross layout with "prompt" generalised to "the parent's path"."""
        dev = torch.device(device)

        def build() -> CrossLayout:
            rows, p_len, local = level.path()
            own = self.padded(level.seg, dev)
            return CrossLayout.from_blocks(own, rows.to(dev), p_len.to(dev), local.to(dev), level.seg.lens_q, dev)

        return self.get(self._key("level_cross", level, dev), build)

    def level_compact(self, level: TreeLevel, device: torch.device | str) -> tuple[torch.Tensor, Segments, CrossLayout]:
        """(rows, seg, layout) of a trie level over a compact key row: the parents' paths gathered
        once into [paths | the level's own tokens], so that the padded machinery reads contiguous
        blocks instead of gathering the scattered paths again in every chunk."""
        dev = torch.device(device)

        def build() -> tuple[torch.Tensor, Segments, CrossLayout]:
            lay = self.level_cross(level, dev)
            seg, blocks = level.seg, lay.gs * lay.p_max
            rows = torch.cat([lay.prompt_rows, seg.q_start + torch.arange(seg.total_q, device=dev)])
            return (
                rows,
                dataclasses.replace(seg, q_start=blocks),
                dataclasses.replace(lay, prompt_rows=torch.arange(blocks, device=dev), uniform_p=True),
            )

        return self.get(self._key("level_compact", level, dev), build)

    def level_k_index(self, level: TreeLevel, device: torch.device | str) -> torch.Tensor:
        """[Tk] packed positions of each node's keys ([parent path | own], node after node): the one
        gather the cu_seqlens backends (flash-attn, torch varlen) take."""
        dev = torch.device(device)

        def build() -> torch.Tensor:
            seg = level.seg
            rows, p_len, local = (x.to(dev) for x in level.path())
            aq = torch.arange(seg.max_q, device=dev)
            ap = torch.arange(rows.shape[1], device=dev)
            own = seg.q_start + seg.cu_q[:-1].to(dev).long()[:, None] + aq[None, :]
            idx = torch.cat([rows[local], own], 1)
            valid = torch.cat([ap[None, :] < p_len[:, None], aq[None, :] < seg.lens_q.to(dev)[:, None]], 1)
            return idx[valid]

        return self.get(self._key("level_k_index", level, dev), build)


def layouts_of(plan: Plan) -> Layouts:
    """The plan's Layouts: one per plan, kept in its per-plan cache."""
    return plan.derived(("attention_layouts",), Layouts)
