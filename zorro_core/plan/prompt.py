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

from dataclasses import dataclass, field

import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.protocol import PackedPlan
from zorro_core.plan.segments import Segments, concat_ranges, cu_seqlens


@dataclass
class DedupPlan(PackedPlan):
    """How one RolloutBatch maps onto the packed row and back. See the module docstring."""

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


def group_rows(batch: RolloutBatch, dedup: bool = True) -> torch.Tensor:
    """[B] group id of each row, groups numbered by first appearance.

    Rows share a group iff their real prompt tokens are identical, compared in full
    (torch.unique over whole rows is exact, so no hash collision can merge two prompts).
    Left padding right-aligns the real tokens, so a prompt that is a strict prefix of another
    differs in some column and never merges; what the pad columns hold does not matter.
    """
    b = batch.batch_size
    dev = batch.device
    if not dedup:
        return torch.arange(b, device=dev)
    canon = torch.where(
        batch.prompt_mask.bool(), batch.prompts.long(), torch.full_like(batch.prompts, -1, dtype=torch.long)
    )
    _, inverse = torch.unique(canon, dim=0, return_inverse=True)
    n = int(inverse.max()) + 1
    rows = torch.arange(b, device=dev)
    first = torch.full((n,), b, device=dev, dtype=torch.long).scatter_reduce(0, inverse, rows, reduce="amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(n, device=dev)
    return rank[inverse]


def build_prompt_plan(batch: RolloutBatch, dedup: bool = True, vocab_size: int | None = None) -> DedupPlan:
    """The prompt plan of a batch: rows with identical prompts share one group (`dedup=False`: every
    row is its own group, the plain plan the baselines run). Token ids are checked against
    `vocab_size` when given."""
    if vocab_size is not None:
        batch.check_vocab(vocab_size)
    dev = batch.device
    b, pw = batch.prompts.shape
    rw = batch.responses.shape[1]
    pm, rm = batch.prompt_mask.bool(), batch.response_mask.bool()
    group_of_row = group_rows(batch, dedup)
    rows = torch.arange(b, device=dev)

    plen_row = pm.sum(1)
    rlen = rm.sum(1)
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
    causal_len = plen + lone_rlen

    # Pieces in packed order: prompt g, the response of a lone row right after its prompt,
    # then the responses of shared groups, by group then row.
    garange = torch.arange(g_count, device=dev)
    resp_key = torch.where(single_row, group_of_row * (b + 2) + 1, g_count * (b + 2) + group_of_row * b + rows)
    order = torch.argsort(torch.cat([garange * (b + 2), resp_key]))
    seg_len = torch.cat([plen, rlen])
    seg_len_sorted = seg_len[order]
    seg_start_sorted = torch.cumsum(seg_len_sorted, 0) - seg_len_sorted
    seg_start = torch.empty_like(seg_start_sorted)
    seg_start[order] = seg_start_sorted
    prompt_start, response_start = seg_start[:g_count], seg_start[g_count:]
    cross_rows = (~single_row).nonzero().flatten()
    cross_rows = cross_rows[torch.argsort(response_start[cross_rows])]
    cross_qlen = rlen[cross_rows]
    cross_klen = plen[group_of_row[cross_rows]] + cross_qlen

    # One host sync for every size the rest needs.
    sizes = torch.stack(
        [
            seg_len.sum(),
            causal_len.sum(),
            causal_len.max(),
            cross_qlen.sum() if cross_rows.numel() else seg_len.new_zeros(()),
            cross_klen.sum() if cross_rows.numel() else seg_len.new_zeros(()),
            cross_qlen.max() if cross_rows.numel() else seg_len.new_zeros(()),
            cross_klen.max() if cross_rows.numel() else seg_len.new_zeros(()),
            plen_row.sum(),
            plen.sum(),
            rlen.sum(),
        ]
    ).tolist()
    t, c_tot, c_max, x_qtot, x_ktot, x_qmax, x_kmax, logical_p, unique_p, n_resp = sizes

    # Per packed token: its segment and offset inside it.
    seg_ids_sorted = torch.arange(g_count + b, device=dev)[order]
    token_segment = torch.repeat_interleave(seg_ids_sorted, seg_len_sorted, output_size=t)
    offset = torch.arange(t, device=dev) - torch.repeat_interleave(seg_start_sorted, seg_len_sorted, output_size=t)
    is_prompt = token_segment < g_count
    pg = token_segment.clamp(max=g_count - 1)
    rb = (token_segment - g_count).clamp(min=0)
    token_group = torch.where(is_prompt, pg, group_of_row[rb])
    prompt_tok = batch.prompts[rep_row[pg], (pw - plen[pg] + offset).clamp(0, pw - 1)]
    resp_tok = batch.responses[rb, offset.clamp(0, rw - 1)]
    input_ids = torch.where(is_prompt, prompt_tok, resp_tok).long()
    position_ids = torch.where(is_prompt, offset, plen[token_group] + offset)

    # Response token (b, j) is predicted at the previous packed position; j = 0 from the
    # prompt's last position. Each response keeps its own labels.
    j = torch.arange(rw, device=dev)[None, :]
    g_of_b = group_of_row[:, None]
    pred = torch.where(j == 0, prompt_start[g_of_b] + plen[g_of_b] - 1, response_start[:, None] + j - 1)
    flat_mask = rm.flatten()
    response_flat_index = flat_mask.nonzero().flatten()
    logit_index = pred.flatten()[response_flat_index]
    labels = batch.responses.long().flatten()[response_flat_index]

    causal = Segments(
        0,
        torch.arange(c_tot, device=dev),
        cu_seqlens(causal_len),
        cu_seqlens(causal_len),
        c_max,
        c_max,
        True,
        c_tot,
        c_tot,
    )
    cross = None
    if cross_rows.numel():
        kg = group_of_row[cross_rows]
        starts = torch.stack([prompt_start[kg], response_start[cross_rows]], 1).flatten()
        lens = torch.stack([plen[kg], cross_qlen], 1).flatten()
        xk = concat_ranges(starts, lens, x_ktot)
        cross = Segments(
            c_tot,
            xk,
            cu_seqlens(cross_qlen),
            cu_seqlens(cross_klen),
            x_qmax,
            x_kmax,
            False,
            x_qtot,
            x_ktot,
            kv_prompt_start=prompt_start[kg],
            kv_prompt_len=plen[kg],
            kv_group=kg,
        )

    return DedupPlan(
        batch_size=b,
        response_width=rw,
        num_groups=g_count,
        deduplicated=dedup,
        group_of_row=group_of_row,
        group_rep_row=rep_row,
        group_size=group_size,
        prompt_lens=plen,
        response_lens=rlen,
        prompt_start=prompt_start,
        response_start=response_start,
        input_ids=input_ids,
        position_ids=position_ids,
        token_group=token_group,
        token_segment=token_segment,
        logit_index=logit_index,
        labels=labels,
        response_flat_index=response_flat_index,
        causal=causal,
        cross=cross,
        logical_tokens=logical_p + n_resp,
        logical_prompt_tokens=logical_p,
        unique_prompt_tokens=unique_p,
    )
