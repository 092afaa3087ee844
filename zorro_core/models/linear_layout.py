"""Where the gated DeltaNet adapter's delta-rule segments and conv windows lie, per plan type.

A layout is a list of steps, each one varlen delta-rule call over some segments of path positions
(gathered from the packed row), run in order: a step's segments start either from zeros or from
the final state of a segment of an earlier step. Every segment starts at a multiple of the chunk
in absolute path positions, so each sequence's chunk partition is a one-shot run's. Every packed
token takes its output from exactly one segment (`out_index`). `conv_sources` gives each token's
conv inputs along its own sequence. Both dispatch on the plan type:

- `PromptPlan` (sharing="prompt"): head (shared prompts up to their last chunk boundary, and lone
  sequences whole, from zeros), then branch (per response: the prompt's tail replayed, then the
  response, from the head's state). See zorro_core.models.linear_attention.
- `TriePlan` (sharing="prefix"): node n at path positions [a, e) (a = its depth) runs the segment
  [c, f): c = its parent's f (0 at a root), f = e for a leaf and floor(e / chunk) * chunk for a
  node with children, so its last partial chunk [f, e) is replayed by each child (< chunk tokens,
  possibly spanning several short ancestors). One call per tree level; a segment starts from the
  final state of its nearest ancestor with a non-empty segment (that ancestor's f is this node's
  c: the nodes between have empty segments, c = f), or from zeros. A token at position p of node
  n takes its output from n's segment when p < f(n), else from the first segment along n's
  first-child chain that covers p (the chain's segments follow each other from f(n)). A row that
  ends inside the tree (a prefix of another row) ends at a node end, so its tokens are served
  like any other; the output at p depends on no later token (the rule is causal).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from zorro_core.plan.prompt import PromptPlan
from zorro_core.plan.protocol import Plan
from zorro_core.plan.segments import concat_ranges, cu_seqlens
from zorro_core.plan.trie import TriePlan

DEFAULT_CHUNK = 64


@dataclass
class Calls:
    """Varlen segments of one delta-rule call: packed positions back to back, cu_seqlens."""

    index: torch.Tensor
    """[N] packed positions of the segments' tokens."""
    cu: torch.Tensor
    """[n+1] int32 cumulative lengths."""
    max_len: int
    """Longest segment."""
    padded: torch.Tensor
    """[n, max_len] packed positions as a right-padded batch; T (a zero row) at padding."""
    valid: torch.Tensor
    """[n, max_len] real entries of `padded`."""


@dataclass
class Step:
    """One delta-rule call of a layout."""

    calls: Calls
    state: Optional[torch.Tensor]
    """[n] initial state of each segment: 0 = zeros, 1 + i = the final state of segment i of the
    earlier steps (their segments numbered in step order); None = all zeros."""


@dataclass
class LinearLayout:
    """What every gated DeltaNet layer of one forward needs; built once per plan (see the module docstring)."""

    steps: list[Step]
    """The delta-rule calls, in order; every step but the last returns its final states."""
    out_index: torch.Tensor
    """[T] position in cat(outputs of all steps) of each packed token's output."""


def calls_of(index: torch.Tensor, seg_len: torch.Tensor, t: int) -> Calls:
    """The Calls of segments of `seg_len` tokens whose packed positions are `index`, back to back."""
    dev = index.device
    max_len = int(seg_len.max()) if seg_len.numel() else 0
    cu = cu_seqlens(seg_len)
    a = torch.arange(max_len, device=dev)
    valid = a[None, :] < seg_len[:, None]
    flat = torch.where(valid, cu[:-1, None].long() + a[None, :], 0)
    padded = torch.where(valid, index[flat] if index.numel() else flat, t)
    return Calls(index, cu, max_len, padded, valid)


def _segments(pieces_start: torch.Tensor, pieces_len: torch.Tensor, pieces_per_segment: int, t: int) -> Calls:
    index = concat_ranges(pieces_start, pieces_len, int(pieces_len.sum()))
    return calls_of(index, pieces_len.view(-1, pieces_per_segment).sum(1), t)


@functools.singledispatch
def conv_sources(plan: Plan, kernel_size: int) -> torch.Tensor:
    """[T, K] packed position of each token's conv inputs, oldest first (itself last); T where none (zero)."""
    raise NotImplementedError(f"no gated DeltaNet conv layout for a {type(plan).__name__}")


@functools.singledispatch
def build_linear_layout(plan: Plan, chunk: int = DEFAULT_CHUNK) -> LinearLayout:
    """The delta-rule steps of `plan` (see the module docstring)."""
    raise NotImplementedError(f"no gated DeltaNet delta-rule layout for a {type(plan).__name__}")


# ---------------------------------------------------------------- the prompt plan


@conv_sources.register
def _(plan: PromptPlan, kernel_size: int) -> torch.Tensor:
    dev = plan.device
    t = plan.num_tokens
    # Conv inputs: the d-th predecessor of a response token inside its response is t - d, before
    # it the prompt's position pos - d; of a prompt token, its prompt's position pos - d.
    pos = plan.position_ids
    grp = plan.token_group
    is_resp = plan.token_segment >= plan.num_groups
    offset = pos - plan.prompt_lens[grp]
    tok = torch.arange(t, device=dev)
    d = torch.arange(kernel_size - 1, -1, -1, device=dev)[None, :]  # oldest first
    src = torch.where(
        is_resp[:, None] & (offset[:, None] >= d), tok[:, None] - d, plan.prompt_start[grp][:, None] + pos[:, None] - d
    )
    return torch.where(pos[:, None] >= d, src, t)


@build_linear_layout.register
def _(plan: PromptPlan, chunk: int = DEFAULT_CHUNK) -> LinearLayout:
    dev = plan.device
    t = plan.num_tokens
    g_count = plan.num_groups
    plen = plan.prompt_lens
    shared = plan.group_size > 1

    # Head: shared prompts up to the fork (maybe empty: then the branches start from zeros), and
    # the whole [prompt][response] of one-member groups (contiguous in the packed row).
    lone_len = torch.zeros(g_count, dtype=torch.long, device=dev).index_add(
        0, plan.group_of_row, torch.where(shared[plan.group_of_row], 0, plan.response_lens)
    )
    fork = torch.where(shared, plen // chunk * chunk, plen)
    head_len = fork + lone_len
    keep = (head_len > 0).nonzero().flatten()
    head = _segments(plan.prompt_start[keep], head_len[keep], 1, t)
    seg_of_group = torch.full((g_count,), -1, dtype=torch.long, device=dev)
    seg_of_group[keep] = torch.arange(keep.numel(), device=dev)

    steps = [Step(head, None)] if head.index.numel() else []
    merge = torch.empty(t, dtype=torch.long, device=dev)
    merge[head.index] = torch.arange(head.index.numel(), device=dev)
    rows = (shared[plan.group_of_row]).nonzero().flatten()
    if rows.numel():
        rows = rows[torch.argsort(plan.response_start[rows])]
        g = plan.group_of_row[rows]
        tail_start = plan.prompt_start[g] + fork[g]
        tail_len = plen[g] - fork[g]
        starts = torch.stack([tail_start, plan.response_start[rows]], 1).flatten()
        lens = torch.stack([tail_len, plan.response_lens[rows]], 1).flatten()
        branch = _segments(starts, lens, 2, t)
        steps.append(Step(branch, seg_of_group[g] + 1))
        # Every response token from its own branch; a prompt's tail from its first row's branch.
        n_b = branch.index.numel()
        seg_len = tail_len + plan.response_lens[rows]
        in_tail = torch.arange(n_b, device=dev) - torch.repeat_interleave(
            branch.cu[:-1].long(), seg_len, output_size=n_b
        ) < torch.repeat_interleave(tail_len, seg_len, output_size=n_b)
        first_row = torch.repeat_interleave(plan.group_rep_row[g] == rows, seg_len, output_size=n_b)
        use = ~in_tail | first_row
        merge[branch.index[use]] = head.index.numel() + torch.arange(n_b, device=dev)[use]
    return LinearLayout(steps, merge)


# ---------------------------------------------------------------- the trie plan


def _path_packed(plan: TriePlan, node: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Packed position of path position d (< the node's end) on the path of `node` (both [N]):
    the ancestor-or-self of the node that holds d, found by walking up (at most depth steps)."""
    cur = node
    while True:
        up = plan.node_depth[cur] > d
        if not bool(up.any()):
            break
        cur = torch.where(up, plan.node_parent[cur], cur)
    return plan.node_start[cur] + d - plan.node_depth[cur]


@conv_sources.register
def _(plan: TriePlan, kernel_size: int) -> torch.Tensor:
    t = plan.num_tokens
    pos = plan.position_ids
    d = torch.arange(kernel_size - 1, -1, -1, device=plan.device)[None, :]  # oldest first
    want = pos[:, None] - d  # path positions of the window, along the token's own path
    node = plan.token_node[:, None].expand_as(want)
    src = _path_packed(plan, node.flatten(), want.clamp(min=0).flatten()).view_as(want)
    return torch.where(want >= 0, src, t)


@build_linear_layout.register
def _(plan: TriePlan, chunk: int = DEFAULT_CHUNK) -> LinearLayout:
    dev, t = plan.device, plan.num_tokens
    c, f, first_child = plan.chunk_segments(chunk)
    seg_len = f - c
    parent, level = plan.node_parent, plan.node_level
    # Each node's state source: the nearest ancestor with a non-empty segment (-1: zeros), level by level.
    src = torch.full_like(parent, -1)
    for lvl in range(1, plan.depth):
        at = (level == lvl).nonzero().flatten()
        p = parent[at]
        src[at] = torch.where(seg_len[p] > 0, p, src[p])
    # Segments numbered in step order (level by level, packed order within a level).
    order = torch.argsort(level * (plan.num_nodes + 1) + torch.arange(plan.num_nodes, device=dev))
    order = order[seg_len[order] > 0]
    seg_no = torch.full_like(parent, -1)
    seg_no[order] = torch.arange(order.numel(), device=dev)
    seg_off = torch.zeros_like(parent)
    seg_off[order] = torch.cumsum(seg_len[order], 0) - seg_len[order]  # in cat(all outputs)
    steps = []
    for lvl in range(plan.depth):
        nodes = order[level[order] == lvl]
        if not nodes.numel():
            continue
        lens = seg_len[nodes]
        n_tok = int(lens.sum())
        owner = torch.repeat_interleave(nodes, lens, output_size=n_tok)
        offset = torch.arange(n_tok, device=dev) - torch.repeat_interleave(
            torch.cumsum(lens, 0) - lens, lens, output_size=n_tok
        )
        index = _path_packed(plan, owner, c[owner] + offset)
        state = None if lvl == 0 else torch.where(src[nodes] >= 0, seg_no[src[nodes].clamp(min=0)] + 1, 0)
        steps.append(Step(calls_of(index, lens, t), state))
    # Each token from its own node's segment, or past its node's f from the first-child chain.
    pos = plan.position_ids
    serve = plan.token_node
    while True:
        move = pos >= f[serve]
        if not bool(move.any()):
            break
        serve = torch.where(move, first_child[serve], serve)
    return LinearLayout(steps, seg_off[serve] + pos - c[serve])
