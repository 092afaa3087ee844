"""The trie's nodes on the packed row: their order (level by level, grouped by parent), numbering,
the per-token maps, each row's path, and the log-probs rows share.

Host code over the O(B) live nodes of zorro_core.plan.trie_radix, then vectorised torch code per
token.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from zorro_core.plan.batch import RolloutBatch


def _layout(start, end, parent, row_node, live, plens):
    """Packed order of the live nodes, their levels, multiplicities, first rows and DFS intervals."""
    children: dict[int, list[int]] = {n: [] for n in live}
    roots = []
    for n in live:
        (children[parent[n]] if parent[n] >= 0 else roots).append(n)
    first_row = {n: len(row_node) for n in live}
    rows = {n: 0 for n in live}
    longest_prompt = {n: 0 for n in live}  # over the rows through the node
    for r, n in enumerate(row_node):
        rows[n] += 1
        longest_prompt[n] = max(longest_prompt[n], int(plens[r]))
        first_row[n] = min(first_row[n], r)
    level = {n: 0 for n in roots}
    frontier = list(roots)
    while frontier:
        nxt = [c for n in frontier for c in children[n]]
        for c in nxt:
            level[c] = level[parent[c]] + 1
        frontier = nxt
    for lvl_nodes in reversed(_by_level(live, level)):  # bottom-up: multiplicity and first row
        for n in lvl_nodes:
            if parent[n] >= 0:
                rows[parent[n]] += rows[n]
                first_row[parent[n]] = min(first_row[parent[n]], first_row[n])
                longest_prompt[parent[n]] = max(longest_prompt[parent[n]], longest_prompt[n])
    order_by_level = [sorted(roots, key=first_row.__getitem__)]
    while True:
        rank = {n: i for i, n in enumerate(order_by_level[-1])}
        nxt = [c for n in order_by_level[-1] for c in children[n]]
        if not nxt:
            break
        order_by_level.append(sorted(nxt, key=lambda c: (rank[parent[c]], first_row[c])))
    packed = [n for lvl in order_by_level for n in lvl]
    # Depth-first intervals for the ancestor test.
    tin, tout = {}, {}
    clock = 0
    stack = [(n, False) for n in reversed(order_by_level[0])]
    while stack:
        n, done = stack.pop()
        if done:
            tout[n] = clock
            continue
        tin[n] = clock
        clock += 1
        stack.append((n, True))
        stack.extend((c, False) for c in reversed(children[n]))
    prompt_tokens = sum(min(max(longest_prompt[n] - start[n], 0), end[n] - start[n]) for n in live)
    return packed, order_by_level, level, rows, first_row, tin, tout, prompt_tokens


def _by_level(nodes, level):
    out: list[list[int]] = []
    for n in nodes:
        while len(out) <= level[n]:
            out.append([])
        out[level[n]].append(n)
    return out


class _Nodes(NamedTuple):
    """The live nodes renumbered 0..M-1 in packed order, as host tensors."""

    new: dict[int, int]
    """Node id of the tree walk -> packed number."""
    depth: torch.Tensor
    """[M] path position of each node's first token."""
    length: torch.Tensor
    """[M] tokens of each node."""
    start: torch.Tensor
    """[M] packed position of each node's first token."""
    parent: torch.Tensor
    """[M] parent (-1 for a root)."""
    level: torch.Tensor
    """[M] number of ancestors."""
    rows: torch.Tensor
    """[M] rows through each node."""
    rep: torch.Tensor
    """[M] first row through each node (its tokens are read from that row)."""
    tin: torch.Tensor
    """[M] DFS entry index."""
    tout: torch.Tensor
    """[M] DFS exit index."""
    row_node: torch.Tensor
    """[B] node each row ends in."""
    total: int
    """T, packed tokens."""


def _number_nodes(packed, start, end, parent, level, rows, first_row, tin, tout, row_node) -> _Nodes:
    """Renumber nodes 0..M-1 in packed order; everything after this is vectorised."""
    new = {n: i for i, n in enumerate(packed)}
    t64 = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    depth = t64([start[n] for n in packed])
    nlen = t64([end[n] - start[n] for n in packed])
    par = t64([new[parent[n]] if parent[n] >= 0 else -1 for n in packed])
    lvl = t64([level[n] for n in packed])
    nrows = t64([rows[n] for n in packed])
    rep = t64([first_row[n] for n in packed])
    ntin, ntout = t64([tin[n] for n in packed]), t64([tout[n] for n in packed])
    rnode = t64([new[n] for n in row_node])
    nstart = torch.cumsum(nlen, 0) - nlen
    return _Nodes(new, depth, nlen, nstart, par, lvl, nrows, rep, ntin, ntout, rnode, int(nlen.sum()))


def _token_maps(nodes: _Nodes, canon: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per packed token: (node, position along its path, token id read from the node's first row)."""
    t = nodes.total
    token_node = torch.repeat_interleave(torch.arange(nodes.length.numel()), nodes.length, output_size=t)
    offset = torch.arange(t) - nodes.start[token_node]
    position_ids = nodes.depth[token_node] + offset
    canon_t = torch.from_numpy(canon)
    input_ids = canon_t[nodes.rep[token_node], position_ids]
    return token_node, position_ids, input_ids


class _RowPaths(NamedTuple):
    """Each row's path (root first) as [B, K] depth starts and packed starts, for depth -> position."""

    depth: torch.Tensor
    """[B, K] path depth where each node of the row's path starts (beyond the path: past every row)."""
    start: torch.Tensor
    """[B, K] packed position of each of those nodes (0 beyond the path)."""

    def packed_at(self, row: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        """Packed position of path depth d of row `row` (row [n], d [n, w])."""
        pd = self.depth[row]
        j = torch.searchsorted(pd, d.contiguous(), right=True) - 1
        return self.start[row].gather(1, j) + d - pd.gather(1, j)


def _row_paths(nodes: _Nodes, lens: np.ndarray) -> _RowPaths:
    """Walk each row's end node up to its root (host lists) and pad the paths into [B, K]."""
    par_l, paths = nodes.parent.tolist(), []
    for n in nodes.row_node.tolist():
        path = []
        while n >= 0:
            path.append(n)
            n = par_l[n]
        paths.append(path[::-1])
    k = max(len(p) for p in paths)
    path_nodes = torch.full((len(paths), k), -1, dtype=torch.long)
    for r, p in enumerate(paths):
        path_nodes[r, : len(p)] = torch.tensor(p, dtype=torch.long)
    big = int(lens.max()) + 1
    path_depth = torch.where(path_nodes >= 0, nodes.depth[path_nodes.clamp(min=0)], big)
    path_start = torch.where(path_nodes >= 0, nodes.start[path_nodes.clamp(min=0)], 0)
    return _RowPaths(path_depth, path_start)


def _shared_logprobs(
    batch: RolloutBatch, plens: np.ndarray, paths: _RowPaths
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logit_index, labels, response_flat_index, response_logit): each (position, label) once.

    Response token (b, j) at depth P_b + j is predicted at depth P_b + j - 1; rows that share
    that position and the label share one log-prob."""
    b, rw = batch.responses.shape
    plen_t = torch.from_numpy(plens).long()
    rm = batch.response_mask.bool().cpu()
    jj = torch.arange(rw)[None, :]
    pred_depth = torch.where(rm, plen_t[:, None] + jj - 1, 0)
    pred = paths.packed_at(torch.arange(b), pred_depth)
    response_flat_index = rm.flatten().nonzero().flatten()
    pos = pred.flatten()[response_flat_index]
    lab = batch.responses.long().cpu().flatten()[response_flat_index]
    width = int(lab.max()) + 1
    keys, response_logit = torch.unique(pos * width + lab, return_inverse=True)
    return keys // width, keys % width, response_flat_index, response_logit
