"""The dedup plan: everything computed once per batch from token ids alone.

Packed layout, one row: first the self-causal segments, one per group in order of first
appearance (the prompt of a shared group; prompt + response of a group with one member),
then the responses of the shared groups (by group, then batch order). Prompt tokens sit at
positions 0..P-1 and each response continues at P. Each unique prompt appears once.

Attention is two variable-length calls over that row, each on a contiguous slice of queries:
- `causal`: tokens [0, Tc): self-causal segments (queries = keys). A one-member group runs
  exactly like the baseline's packed sequence.
- `cross`: tokens [Tc, T): each response of a shared group; its keys are its prompt followed
  by itself, causal aligned bottom-right.
Pure tensor code: no model, no per-token or per-row Python loop, a bounded number of host
synchronisations.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.protocol import PackedPlan
from zorro_core.plan.segments import Segments, concat_ranges, cu_seqlens


@dataclass
class PromptPlan(PackedPlan):
    """How one RolloutBatch maps onto the packed row and back (sharing="prompt"). See the module docstring.

    The baseline's plan is a PromptPlan too, with every row its own group (`deduplicated=False`); it was
    called DedupPlan until 0.1, a name that still imports with a DeprecationWarning."""

    batch_size: int
    """B, rows of the batch."""
    response_width: int
    """R, padded width of the responses."""
    num_groups: int
    """G, distinct prompts (B when dedup is off)."""
    deduplicated: bool
    """Whether rows with identical prompts were merged."""
    group_of_row: torch.Tensor
    """[B] group of each batch row."""
    group_rep_row: torch.Tensor
    """[G] the first batch row of each group."""
    group_size: torch.Tensor
    """[G] rows in each group."""
    prompt_lens: torch.Tensor
    """[G] real prompt tokens of each group."""
    response_lens: torch.Tensor
    """[B] real response tokens of each row."""
    prompt_start: torch.Tensor
    """[G] packed position of each group's first prompt token."""
    response_start: torch.Tensor
    """[B] packed position of each row's first response token."""
    input_ids: torch.Tensor
    """[T] packed token ids."""
    position_ids: torch.Tensor
    """[T] positions: prompts from 0, responses continue from their prompt's length."""
    token_group: torch.Tensor
    """[T] group of each packed token."""
    token_segment: torch.Tensor
    """[T] segment of each packed token: g < G for prompt g, G + b for the response of row b."""
    logit_index: torch.Tensor
    """[N] packed position whose output predicts each real response token (row-major in [B, R])."""
    labels: torch.Tensor
    """[N] the response token predicted there."""
    response_flat_index: torch.Tensor
    """[N] index of each real response token in the flattened [B*R] layout."""
    causal: Segments
    """Self-causal segments: shared prompts, and whole sequences of one-member groups."""
    cross: Segments | None
    """Responses of shared groups against [their prompt + themselves]; None when nothing is shared."""
    logical_tokens: int
    """Real tokens of the batch before dedup (sum of prompt + response lengths)."""
    logical_prompt_tokens: int
    """Real prompt tokens of the batch before dedup."""
    unique_prompt_tokens: int
    """Prompt tokens after dedup."""
    sharing: str = "prompt"
    """The sharing mode that built this plan."""
    _derived: dict = field(default_factory=dict, init=False, repr=False)

    def token_multiplicity(self) -> torch.Tensor:
        """[T] float64: rows that contain each packed token (a prompt token: its group's size)."""
        size = self.group_size[self.token_group].to(torch.float64)
        return torch.where(self.token_segment < self.num_groups, size, torch.ones_like(size))

    def attended_pairs(self) -> int:
        """Query-key pairs of one attention layer: the causal call's plus the cross call's."""
        return self.causal.attended_pairs() + (self.cross.attended_pairs() if self.cross is not None else 0)

    def scatter_responses(self, values: torch.Tensor) -> torch.Tensor:
        """Put [N] per-response-token values back into the batch's [B, R] layout (0 at padding)."""
        out = values.new_zeros(self.batch_size * self.response_width)
        return out.index_put((self.response_flat_index,), values).view(self.batch_size, self.response_width)

    def attention_mask(self) -> torch.Tensor:
        """[T, T] bool: may query i attend key j (mask mode). Quadratic: small inputs only."""
        i = torch.arange(self.num_tokens, device=self.device)
        same_group = self.token_group[:, None] == self.token_group[None, :]
        causal = i[None, :] <= i[:, None]
        is_prompt_k = (self.token_segment < self.num_groups)[None, :]
        same_seg = self.token_segment[:, None] == self.token_segment[None, :]
        return same_group & causal & (is_prompt_k | same_seg)


def prompt_groups(
    prompts: torch.Tensor, prompt_mask: torch.Tensor | None = None, left_padded: bool = False
) -> torch.Tensor:
    """[B] group id of each row of `prompts` [B, P], groups numbered 0.. by first appearance.

    Rows share a group iff their real prompt tokens (`prompt_mask` 1; every column without a mask)
    are the same tokens in the same order. Where the padding sits does not matter: each row's real
    tokens are right-aligned first, and its length is part of the key, so padding never equals a
    token and a prompt that is a strict prefix of another never merges with it. Compared in full
    (torch.unique over whole rows is exact: no hash collision can merge two prompts).
    `left_padded`: the caller guarantees what a RolloutBatch does (real tokens end at the last
    column, token ids >= 0), so the rows are compared as they are, the padding read as -1.
    """
    if prompts.dim() != 2:
        raise ValueError(f"prompts must be 2-D [rows, columns], got shape {tuple(prompts.shape)}")
    b, p = prompts.shape
    dev = prompts.device
    if b == 0:
        return torch.zeros(0, dtype=torch.long, device=dev)
    tokens = prompts.long()
    if prompt_mask is None:
        lens = torch.full((b,), p, dtype=torch.long, device=dev)
        aligned = tokens
    elif left_padded:  # already aligned: no realignment (the plan's hot path)
        if prompt_mask.shape != prompts.shape:
            raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} does not match prompts {tuple(prompts.shape)}")
        return _first_appearance(torch.where(prompt_mask.bool(), tokens, -1))
    else:
        if prompt_mask.shape != prompts.shape:
            raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} does not match prompts {tuple(prompts.shape)}")
        real = prompt_mask.bool()
        lens = real.sum(1)
        column = real.long().cumsum(1) - 1 + (p - lens)[:, None]
        rows = torch.arange(b, device=dev)[:, None].expand(b, p)
        aligned = torch.zeros_like(tokens).index_put((rows[real], column[real]), tokens[real])
    return _first_appearance(torch.cat([lens[:, None], aligned], 1))


def _first_appearance(keys: torch.Tensor) -> torch.Tensor:
    """[B] id of each row of `keys` among the distinct rows, numbered by first appearance."""
    b, dev = keys.shape[0], keys.device
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    n = int(inverse.max()) + 1
    order = torch.arange(b, device=dev)
    first = torch.full((n,), b, device=dev, dtype=torch.long).scatter_reduce(0, inverse, order, reduce="amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(n, device=dev)
    return rank[inverse]


def group_rows(batch: RolloutBatch, dedup: bool = True) -> torch.Tensor:
    """[B] group id of each row, groups numbered by first appearance: `prompt_groups` of the
    batch's prompts (every row its own group without `dedup`)."""
    if not dedup:
        return torch.arange(batch.batch_size, device=batch.device)
    return prompt_groups(batch.prompts, batch.prompt_mask, left_padded=True)


class _Groups(NamedTuple):
    """The batch's rows by group: the lengths and counts every later step reads."""

    num: int
    """G."""
    of_row: torch.Tensor
    """[B] group of each row."""
    rep_row: torch.Tensor
    """[G] first row of each group."""
    size: torch.Tensor
    """[G] rows in each group."""
    prompt_len_row: torch.Tensor
    """[B] real prompt tokens of each row."""
    prompt_len: torch.Tensor
    """[G] real prompt tokens of each group."""
    response_len: torch.Tensor
    """[B] real response tokens of each row."""
    lone_row: torch.Tensor
    """[B] whether the row is the only one of its group."""
    causal_len: torch.Tensor
    """[G] length of each group's self-causal segment."""


class _PackedOrder(NamedTuple):
    """The segments (G prompts, then B responses, by id) in packed order and where each starts."""

    order: torch.Tensor
    """[G+B] segment ids in packed order."""
    seg_len: torch.Tensor
    """[G+B] length of each segment, by id."""
    len_sorted: torch.Tensor
    """[G+B] the lengths in packed order."""
    start_sorted: torch.Tensor
    """[G+B] the packed starts in packed order."""
    prompt_start: torch.Tensor
    """[G] packed position of each group's first prompt token."""
    response_start: torch.Tensor
    """[B] packed position of each row's first response token."""


class _CrossRows(NamedTuple):
    """The rows of shared groups, in packed order: the cross call's segments."""

    rows: torch.Tensor
    """[n] batch row of each cross segment."""
    q_len: torch.Tensor
    """[n] its queries: the row's response."""
    k_len: torch.Tensor
    """[n] its keys: the group's prompt, then the response."""


class _Sizes(NamedTuple):
    """Every size the plan needs on the host, read in one synchronisation."""

    tokens: int
    causal_total: int
    causal_max: int
    cross_q_total: int
    cross_k_total: int
    cross_q_max: int
    cross_k_max: int
    logical_prompt: int
    unique_prompt: int
    response_tokens: int


def _group_table(batch: RolloutBatch, group_of_row: torch.Tensor) -> _Groups:
    """Representative row, size and lengths of each group (the group count is read on the host);
    a lone row's response joins its group's self-causal segment."""
    dev = batch.device
    b = batch.prompts.shape[0]
    rows = torch.arange(b, device=dev)
    plen_row = batch.prompt_mask.bool().sum(1)
    rlen = batch.response_mask.bool().sum(1)
    g_count = int(group_of_row.max()) + 1
    rep_row = torch.full((g_count,), b, device=dev, dtype=torch.long).scatter_reduce(
        0, group_of_row, rows, reduce="amin"
    )
    group_size = torch.bincount(group_of_row, minlength=g_count)
    plen = plen_row[rep_row]
    single = group_size == 1
    single_row = single[group_of_row]
    # Self-causal segments, one per group: the prompt, or prompt + response for a lone row.
    lone_rlen = torch.zeros(g_count, device=dev, dtype=torch.long).index_add(
        0, group_of_row, torch.where(single_row, rlen, 0)
    )
    return _Groups(g_count, group_of_row, rep_row, group_size, plen_row, plen, rlen, single_row, plen + lone_rlen)


def _packed_order(groups: _Groups) -> _PackedOrder:
    """Pieces in packed order: prompt g, the response of a lone row right after its prompt,
    then the responses of shared groups, by group then row."""
    g_count, group_of_row = groups.num, groups.of_row
    b = group_of_row.shape[0]
    dev = group_of_row.device
    rows = torch.arange(b, device=dev)
    garange = torch.arange(g_count, device=dev)
    resp_key = torch.where(groups.lone_row, group_of_row * (b + 2) + 1, g_count * (b + 2) + group_of_row * b + rows)
    order = torch.argsort(torch.cat([garange * (b + 2), resp_key]))
    seg_len = torch.cat([groups.prompt_len, groups.response_len])
    seg_len_sorted = seg_len[order]
    seg_start_sorted = torch.cumsum(seg_len_sorted, 0) - seg_len_sorted
    seg_start = torch.empty_like(seg_start_sorted)
    seg_start[order] = seg_start_sorted
    return _PackedOrder(order, seg_len, seg_len_sorted, seg_start_sorted, seg_start[:g_count], seg_start[g_count:])


def _cross_rows(groups: _Groups, packed: _PackedOrder) -> _CrossRows:
    """The rows of shared groups in packed order, with their query and key lengths."""
    cross_rows = (~groups.lone_row).nonzero().flatten()
    cross_rows = cross_rows[torch.argsort(packed.response_start[cross_rows])]
    cross_qlen = groups.response_len[cross_rows]
    cross_klen = groups.prompt_len[groups.of_row[cross_rows]] + cross_qlen
    return _CrossRows(cross_rows, cross_qlen, cross_klen)


def _host_sizes(groups: _Groups, packed: _PackedOrder, cross: _CrossRows) -> _Sizes:
    """One host sync for every size the rest needs: a single `.tolist()` of the stacked sizes."""
    seg_len, causal_len = packed.seg_len, groups.causal_len
    shared = cross.rows.numel() > 0  # a shape: no sync
    zero = seg_len.new_zeros(())
    sizes = torch.stack(
        [
            seg_len.sum(),
            causal_len.sum(),
            causal_len.max(),
            cross.q_len.sum() if shared else zero,
            cross.k_len.sum() if shared else zero,
            cross.q_len.max() if shared else zero,
            cross.k_len.max() if shared else zero,
            groups.prompt_len_row.sum(),
            groups.prompt_len.sum(),
            groups.response_len.sum(),
        ]
    ).tolist()
    return _Sizes(*sizes)


def _token_maps(
    batch: RolloutBatch, groups: _Groups, packed: _PackedOrder, t: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed token: (segment, group, token id, position), from its segment and offset in it."""
    g_count, plen = groups.num, groups.prompt_len
    b, pw = batch.prompts.shape
    rw = batch.responses.shape[1]
    dev = batch.device
    seg_ids_sorted = torch.arange(g_count + b, device=dev)[packed.order]
    token_segment = torch.repeat_interleave(seg_ids_sorted, packed.len_sorted, output_size=t)
    offset = torch.arange(t, device=dev) - torch.repeat_interleave(
        packed.start_sorted, packed.len_sorted, output_size=t
    )
    is_prompt = token_segment < g_count
    pg = token_segment.clamp(max=g_count - 1)
    rb = (token_segment - g_count).clamp(min=0)
    token_group = torch.where(is_prompt, pg, groups.of_row[rb])
    prompt_tok = batch.prompts[groups.rep_row[pg], (pw - plen[pg] + offset).clamp(0, pw - 1)]
    resp_tok = batch.responses[rb, offset.clamp(0, rw - 1)]
    input_ids = torch.where(is_prompt, prompt_tok, resp_tok).long()
    position_ids = torch.where(is_prompt, offset, plen[token_group] + offset)
    return token_segment, token_group, input_ids, position_ids


def _response_logprob_index(
    batch: RolloutBatch, groups: _Groups, packed: _PackedOrder
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(response_flat_index, logit_index, labels) of the real response tokens, row-major in [B, R].

    Response token (b, j) is predicted at the previous packed position; j = 0 from the prompt's
    last position. Each response keeps its own labels."""
    rw = batch.responses.shape[1]
    j = torch.arange(rw, device=batch.device)[None, :]
    g_of_b = groups.of_row[:, None]
    plen = groups.prompt_len
    pred = torch.where(j == 0, packed.prompt_start[g_of_b] + plen[g_of_b] - 1, packed.response_start[:, None] + j - 1)
    flat_mask = batch.response_mask.bool().flatten()
    response_flat_index = flat_mask.nonzero().flatten()
    logit_index = pred.flatten()[response_flat_index]
    labels = batch.responses.long().flatten()[response_flat_index]
    return response_flat_index, logit_index, labels


def _causal_segments(groups: _Groups, sizes: _Sizes) -> Segments:
    """The self-causal call: tokens [0, Tc), one segment per group, queries = keys."""
    c_tot, c_max, causal_len = sizes.causal_total, sizes.causal_max, groups.causal_len
    return Segments(
        0,
        torch.arange(c_tot, device=causal_len.device),
        cu_seqlens(causal_len),
        cu_seqlens(causal_len),
        c_max,
        c_max,
        True,
        c_tot,
        c_tot,
    )


def _cross_segments(groups: _Groups, packed: _PackedOrder, cross: _CrossRows, sizes: _Sizes) -> Segments | None:
    """The cross call: each response of a shared group against [its prompt + itself]; None when
    nothing is shared."""
    if not cross.rows.numel():
        return None
    kg = groups.of_row[cross.rows]
    prompt_start, plen = packed.prompt_start[kg], groups.prompt_len[kg]
    starts = torch.stack([prompt_start, packed.response_start[cross.rows]], 1).flatten()
    lens = torch.stack([plen, cross.q_len], 1).flatten()
    xk = concat_ranges(starts, lens, sizes.cross_k_total)
    return Segments(
        sizes.causal_total,
        xk,
        cu_seqlens(cross.q_len),
        cu_seqlens(cross.k_len),
        sizes.cross_q_max,
        sizes.cross_k_max,
        False,
        sizes.cross_q_total,
        sizes.cross_k_total,
        kv_prompt_start=prompt_start,
        kv_prompt_len=plen,
        kv_group=kg,
    )


def build_prompt_plan(
    batch: RolloutBatch,
    dedup: bool = True,
    vocab_size: int | None = None,
    group_of_row: torch.Tensor | None = None,
) -> PromptPlan:
    """The prompt plan of a batch: rows with identical prompts share one group (`dedup=False`: every
    row is its own group, the plain plan the baselines run). Token ids are checked against
    `vocab_size` when given. `group_of_row` [B] (groups 0.. numbered by first appearance) replaces
    the grouping by tokens: a caller whose prompts hold more than tokens (images:
    zorro_core.plan.multimodal) groups rows by the whole prompt; rows of one group must have the
    same prompt tokens."""
    if vocab_size is not None:
        batch.check_vocab(vocab_size)
    groups = _group_table(batch, group_rows(batch, dedup) if group_of_row is None else group_of_row)
    packed = _packed_order(groups)
    cross_rows = _cross_rows(groups, packed)
    sizes = _host_sizes(groups, packed, cross_rows)
    token_segment, token_group, input_ids, position_ids = _token_maps(batch, groups, packed, sizes.tokens)
    response_flat_index, logit_index, labels = _response_logprob_index(batch, groups, packed)
    return PromptPlan(
        batch_size=batch.prompts.shape[0],
        response_width=batch.responses.shape[1],
        num_groups=groups.num,
        deduplicated=dedup,
        group_of_row=groups.of_row,
        group_rep_row=groups.rep_row,
        group_size=groups.size,
        prompt_lens=groups.prompt_len,
        response_lens=groups.response_len,
        prompt_start=packed.prompt_start,
        response_start=packed.response_start,
        input_ids=input_ids,
        position_ids=position_ids,
        token_group=token_group,
        token_segment=token_segment,
        logit_index=logit_index,
        labels=labels,
        response_flat_index=response_flat_index,
        causal=_causal_segments(groups, sizes),
        cross=_cross_segments(groups, packed, cross_rows, sizes),
        logical_tokens=sizes.logical_prompt + sizes.response_tokens,
        logical_prompt_tokens=sizes.logical_prompt,
        unique_prompt_tokens=sizes.unique_prompt,
    )


def __getattr__(name: str) -> object:
    # The name before 0.2 (it named the baseline's plan as well): kept for one release.
    if name == "DedupPlan":
        warnings.warn(
            "zorro_core.plan.prompt.DedupPlan is now PromptPlan (removed after 2027-06-01)",
            DeprecationWarning,
            stacklevel=2,
        )
        return PromptPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
