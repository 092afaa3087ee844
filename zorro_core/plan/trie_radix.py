"""The prefix-tree plan's trie, built on the host: the rows in token order, their radix tree, and the
folding of short inner nodes (`min_shared_tokens`).

The rows are copied to the host once, sorted as bytes, one vectorised longest-common-prefix pass
gives what adjacent rows share, then a Python stack walk over the B sorted rows builds the O(B)
nodes. `shared_nodes` and `shared_depths` run the same walk from the rows' lengths alone (a
dataset's simulation, the trie's micro-batch balance).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np
import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.sharing import DEFAULT_MIN_SHARED_TOKENS, check_sharing


def _rows_on_host(batch: RolloutBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([B, L] int64 real tokens, prompt first, -1 after the row's end; [B] lengths; [B] prompt lengths)."""
    pm, rm = batch.prompt_mask.bool(), batch.response_mask.bool()
    pw = pm.shape[1]
    ids = torch.cat([batch.prompts, batch.responses], 1).long()
    plen = pm.sum(1)
    lens = plen + rm.sum(1)
    # Left padding: shift each row left by its prompt padding so real tokens start at column 0.
    cols = torch.arange(ids.shape[1], device=ids.device)[None, :] + (pw - plen)[:, None]
    canon = torch.where(cols < ids.shape[1], ids.gather(1, cols.clamp(max=ids.shape[1] - 1)), -1)
    canon = torch.where(torch.arange(ids.shape[1], device=ids.device)[None, :] < lens[:, None], canon, -1)
    width = int(lens.max())
    return canon[:, :width].cpu().numpy(), lens.cpu().numpy(), plen.cpu().numpy()


def _sort_rows(canon: np.ndarray, lens: np.ndarray) -> tuple[list[int], list[int]]:
    """(rows in token order, lcp[i] = tokens rows order[i] and order[i + 1] share)."""
    b = canon.shape[0]
    keys = [(canon[i, : lens[i]] + 1).astype(">u4").tobytes() for i in range(b)]
    order = sorted(range(b), key=keys.__getitem__)  # bytes order = token order; a prefix first
    srt = canon[order]
    lcp: list[int] = []
    if b > 1:
        neq = srt[1:] != srt[:-1]
        lcp_a = np.where(neq.any(1), neq.argmax(1), srt.shape[1])
        lcp = np.minimum(lcp_a, np.minimum(lens[order][1:], lens[order][:-1])).tolist()
    return order, lcp


def _radix_tree(canon: np.ndarray, lens: np.ndarray):
    """Nodes (depth start, depth end, parent) of the rows' radix tree and each row's end node."""
    order, lcp = _sort_rows(canon, lens)
    return _radix_walk(order, lens, lcp)


def radix_tree_of(rows: list[list[int]]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The radix tree of token lists (distinct, non-empty): each node's depth start, depth end and
    parent (-1 for a root), and each list's end node; a list that is a prefix of another ends at a
    node boundary. Nodes are numbered in no particular order (walk them by parent)."""
    width = max(len(r) for r in rows)
    canon = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        canon[i, : len(r)] = r
    return _radix_tree(canon, np.array([len(r) for r in rows], dtype=np.int64))


class SortedRows(NamedTuple):
    """A batch's rows in token order (the trie's depth-first order: every subtree is a run of them)."""

    order: list[int]
    """Row of the batch at each sorted position."""
    lens: list[int]
    """Real tokens (prompt + response) of each sorted row."""
    prompt_lens: list[int]
    """Real prompt tokens of each sorted row."""
    lcp: list[int]
    """[B - 1] tokens sorted rows i and i + 1 have in common."""


def sorted_rows(batch: RolloutBatch) -> SortedRows:
    """The rows of `batch` in token order with their lengths and common prefixes (host lists)."""
    canon, lens, plens = _rows_on_host(batch)
    order, lcp = _sort_rows(canon, lens)
    return SortedRows(order, [int(lens[r]) for r in order], [int(plens[r]) for r in order], lcp)


def _radix_walk(order, lens, lcp):
    """The radix tree of rows visited in sorted `order`, lcp[i - 1] tokens shared by order[i - 1] and order[i]."""
    b = len(order)
    start: list[int] = []
    end: list[int] = []
    parent: list[int] = []
    row_node = [0] * b
    stack: list[int] = []  # the previous row's path
    for i, r in enumerate(order):
        length, shared = int(lens[r]), (lcp[i - 1] if i else 0)
        while stack and start[stack[-1]] >= shared:
            stack.pop()
        if stack and end[stack[-1]] > shared:  # split: new upper node y = [start, shared) above x
            x, y = stack[-1], len(start)
            start.append(start[x])
            end.append(shared)
            parent.append(parent[x])
            parent[x], start[x] = y, shared
            stack[-1] = y
        if length > shared:
            stack.append(len(start))
            start.append(shared)
            end.append(length)
            parent.append(stack[-2] if len(stack) > 1 else -1)
        row_node[r] = stack[-1]  # length == shared: identical to the previous row
    return start, end, parent, row_node


def shared_nodes(lens, lcp, plens, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS) -> tuple[list[int], list[int]]:
    """(depth, length) of each node of the trie `build_trie_plan` builds, from the rows' lengths alone
    once they are sorted: rows 0..B-1 in token order, lcp[i] tokens shared by rows i and i + 1, plens
    their prompt lengths (zorro_harness.analyze.workload_sim counts a dataset's calls with it)."""
    check_sharing("prefix", min_shared_tokens)
    start, end, parent, row_node = _radix_walk(range(len(lens)), lens, lcp)
    keep = _prompt_closers(start, end, parent, row_node, plens)
    live = _merge_short(start, end, parent, row_node, min_shared_tokens, keep)
    return [start[n] for n in live], [end[n] - start[n] for n in live]


def shared_depths(lens, lcp, plens, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS) -> list[int]:
    """[B - 1] tokens that sorted rows i and i + 1 share in the trie `build_trie_plan` builds (inputs
    as `shared_nodes`'): where their deepest common node ends. Equals lcp[i] at min_shared_tokens=1;
    smaller where a short common run is folded into (copied into) each child."""
    check_sharing("prefix", min_shared_tokens)
    start, end, parent, row_node = _radix_walk(range(len(lens)), lens, lcp)
    keep = _prompt_closers(start, end, parent, row_node, plens)
    _merge_short(start, end, parent, row_node, min_shared_tokens, keep)  # rows end in live nodes

    def path(n: int) -> set[int]:  # live parents of live nodes are live (folded nodes hand theirs down)
        out = set()
        while n >= 0:
            out.add(n)
            n = parent[n]
        return out

    paths = [path(n) for n in row_node]
    return [max((end[n] for n in paths[i] & paths[i + 1]), default=0) for i in range(len(lens) - 1)]


def _prompt_closers(start, end, parent, row_node, plens) -> set[int]:
    """Nodes that hold some row's last prompt token. Never folded: then every group of rows with
    identical prompts keeps its prompt in shared nodes, as `sharing="prompt"` does."""
    out = set()
    for r, n in enumerate(row_node):
        last = int(plens[r]) - 1
        while start[n] > last:
            n = parent[n]
        out.add(n)
    return out


def _merge_short(start, end, parent, row_node, min_shared: int, keep: set[int]):
    """Fold every inner node shorter than min_shared (and not in `keep`) into its children.
    Returns the live nodes."""
    m = len(start)
    children: list[list[int]] = [[] for _ in range(m)]
    ends_here = [0] * m
    for r in row_node:
        ends_here[r] += 1
    roots: list[int] = []
    for n in range(m):
        (children[parent[n]] if parent[n] >= 0 else roots).append(n)
    alive = [True] * m
    queue = deque(roots)
    while queue:
        n = queue.popleft()
        kids = children[n]
        if kids and end[n] - start[n] < min_shared and n not in keep:
            for c in kids:
                start[c], parent[c] = start[n], parent[n]
            children[n] = []
            alive[n] = ends_here[n] > 0  # kept as a leaf for the rows that end here
        queue.extend(kids)
    return [n for n in range(m) if alive[n]]
