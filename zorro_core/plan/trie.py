"""The prefix-tree plan (`sharing="prefix"`): a token trie over whole rows, each shared run once.

Every row of the batch is its prompt's real tokens followed by its response's (padding removed).
The rows form a radix tree: a *node* is a maximal run of tokens that the same set of rows share,
so a node is computed once however many rows pass through it. A node's tokens attend to every
token of its ancestors and causally to themselves; their positions continue along the path (a
node's first token sits at its *depth*, the number of tokens of its ancestors). A row that is a
prefix of another ends at an inner node; identical rows end at the same node.

Packed layout: the nodes level by level (level = number of ancestors): roots by first appearance
in the batch, then each level's nodes grouped by parent (in the parent's packed order), then by
first appearance. For a batch whose rows share only identical prompts this is the two-level tree
[prompt] -> [response] and the layout is exactly `sharing="prompt"`'s.

Log-probs: response token j of row b is predicted at the packed position of its row's token j - 1
(the prompt's last token for j = 0). Rows that share that position and the label share one
log-prob: `logit_index`/`labels` hold each (position, label) once and `scatter_responses` gathers
them back into [B, R], so a shared log-prob's gradient sums over its rows, as per-row computation.

`min_shared_tokens=N`: an inner node shorter than N tokens is not split off; its tokens are
copied into each child (and kept as a leaf for the rows that end there). A node that holds a
row's last prompt token is always kept, so rows with identical prompts always share them: the
plan never computes more tokens or attention pairs than `sharing="prompt"`. Tiny fragments cost an
attention call level and padding for a few tokens; N = 1 shares every common run, and then the
packed row holds exactly the trie's tokens.

Cost: the trie is built on the host (the rows are copied to the host once, sorted as bytes, one
vectorised longest-common-prefix pass, then a Python stack walk over the B sorted rows and the
O(B) nodes); every per-token map is vectorised torch code.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.layouts import CrossLayout
from zorro_core.plan.protocol import PackedPlan
from zorro_core.plan.segments import Segments, cu_seqlens, same_device

SHARINGS = ("prompt", "prefix")
DEFAULT_MIN_SHARED_TOKENS = 16
"""Default `min_shared_tokens` (see the README's prefix-sharing measurement)."""


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
    _cross: Optional[CrossLayout] = field(default=None, init=False, repr=False)
    _compact: Optional[tuple] = field(default=None, init=False, repr=False)
    _k_index: Optional[torch.Tensor] = field(default=None, init=False, repr=False)

    def path(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Levels >= 1: (prefix_rows, prefix_len, local); level 0 has no ancestors' path."""
        if self.prefix_rows is None or self.prefix_len is None or self.local is None:
            raise ValueError("level 0 (the roots) has no ancestors' path")
        return self.prefix_rows, self.prefix_len, self.local

    def cross_layout(self, device: torch.device) -> CrossLayout:
        """Levels >= 1: the padded layout of [parent path block | own block] keys per node, the
        prompt plan's cross layout with "prompt" generalised to "the parent's path" (built once)."""
        if self._cross is None or not same_device(self._cross.device, device):
            own = self.seg.padded_layout(device)
            rows, p_len, local = self.path()
            self._cross = CrossLayout.from_blocks(
                own,
                rows.to(device),
                p_len.to(device),
                local.to(device),
                self.seg.lens_q,
                device,
            )
            self._compact = None
        return self._cross

    def compact(self, device: torch.device) -> tuple[torch.Tensor, Segments, CrossLayout]:
        """(rows, seg, layout) of the level over a compact key row: the parents' paths gathered once
        into [paths | the level's own tokens], so that the padded machinery reads contiguous blocks
        instead of gathering the scattered paths again in every chunk."""
        lay = self.cross_layout(device)
        if self._compact is None:
            seg, blocks = self.seg, lay.gs * lay.p_max
            rows = torch.cat([lay.prompt_rows, seg.q_start + torch.arange(seg.total_q, device=device)])
            self._compact = (
                rows,
                dataclasses.replace(seg, q_start=blocks),
                dataclasses.replace(lay, prompt_rows=torch.arange(blocks, device=device), uniform_p=True),
            )
        return self._compact

    def k_index(self, device: torch.device) -> torch.Tensor:
        """[Tk] packed positions of each node's keys ([parent path | own], node after node): the one
        gather the cu_seqlens backends (flash-attn, torch varlen) take."""
        if self._k_index is None or self._k_index.device != torch.device(device):
            seg = self.seg
            rows, p_len, local = (x.to(device) for x in self.path())
            aq = torch.arange(seg.max_q, device=device)
            ap = torch.arange(rows.shape[1], device=device)
            own = seg.q_start + seg.cu_q[:-1].to(device).long()[:, None] + aq[None, :]
            idx = torch.cat([rows[local], own], 1)
            valid = torch.cat([ap[None, :] < p_len[:, None], aq[None, :] < seg.lens_q.to(device)[:, None]], 1)
            self._k_index = idx[valid]
        return self._k_index


@dataclass
class TriePlan(PackedPlan):
    """How one RolloutBatch maps onto the packed token trie and back. See the module docstring."""

    batch_size: int
    """B, rows of the batch."""
    response_width: int
    """R, padded width of the responses."""
    min_shared_tokens: int
    """Inner nodes shorter than this were merged into their children."""
    node_depth: torch.Tensor
    """[M] path position of each node's first token (tokens of its ancestors)."""
    node_len: torch.Tensor
    """[M] tokens of each node."""
    node_start: torch.Tensor
    """[M] packed position of each node's first token (nodes in packed order)."""
    node_parent: torch.Tensor
    """[M] parent node (-1 for a root)."""
    node_level: torch.Tensor
    """[M] number of ancestors."""
    node_rows: torch.Tensor
    """[M] rows whose path contains the node (its multiplicity)."""
    node_tin: torch.Tensor
    """[M] pre-order index of a depth-first walk: a is an ancestor-or-self of n iff tin[a] <= tin[n] < tout[a]."""
    node_tout: torch.Tensor
    """[M] tin + size of the node's subtree."""
    row_node: torch.Tensor
    """[B] the node each row ends in."""
    input_ids: torch.Tensor
    """[T] packed token ids."""
    position_ids: torch.Tensor
    """[T] position of each token along its path."""
    token_node: torch.Tensor
    """[T] node of each packed token."""
    logit_index: torch.Tensor
    """[U] packed positions whose output predicts a response token, each (position, label) once."""
    labels: torch.Tensor
    """[U] the token predicted there."""
    response_flat_index: torch.Tensor
    """[N] index of each real response token in the flattened [B*R] layout."""
    response_logit: torch.Tensor
    """[N] which of the U log-probs each real response token receives."""
    levels: list[TreeLevel]
    """Split-mode attention calls, one per level of the tree."""
    logical_tokens: int
    """Real tokens of the batch before dedup (sum of prompt + response lengths)."""
    logical_prompt_tokens: int
    """Real prompt tokens of the batch before dedup."""
    unique_prompt_tokens: int
    """Packed tokens that are a prompt token of at least one row through them."""
    deduplicated: bool = True
    """Always True: a trie plan shares (the baseline runs `build_plain_plan`)."""
    sharing: str = "prefix"
    """The sharing mode that built this plan."""
    _derived: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def num_nodes(self) -> int:
        return self.node_len.numel()

    @property
    def depth(self) -> int:
        """Levels of the tree (attention calls per layer in split mode)."""
        return len(self.levels)

    @property
    def causal(self) -> Segments:
        """Level 0: the roots as self-causal segments."""
        return self.levels[0].seg

    def scatter_responses(self, values: torch.Tensor) -> torch.Tensor:
        """Put [U] per-(position, label) values into the batch's [B, R] layout (0 at padding).

        A gather from the shared values: autograd sums a shared log-prob's gradient over its rows."""
        out = values.new_zeros(self.batch_size * self.response_width)
        out = out.index_put((self.response_flat_index,), values[self.response_logit])
        return out.view(self.batch_size, self.response_width)

    def ancestor_or_self(self, key_node: torch.Tensor, query_node: torch.Tensor) -> torch.Tensor:
        """Whether each key node is an ancestor of (or is) the query node (broadcasting)."""
        tin_q = self.node_tin[query_node]
        return (self.node_tin[key_node] <= tin_q) & (tin_q < self.node_tout[key_node])

    def attention_mask(self) -> torch.Tensor:
        """[T, T] bool: query i sees key j iff j's node is an ancestor-or-self of i's and j <= i
        (ancestors precede their descendants in the packed row). Quadratic: small inputs only."""
        i = torch.arange(self.num_tokens, device=self.device)
        anc = self.ancestor_or_self(self.token_node[None, :], self.token_node[:, None])
        return anc & (i[None, :] <= i[:, None])

    def token_multiplicity(self) -> torch.Tensor:
        """[T] float64: rows that contain each packed token (the MoE aux loss's weights)."""
        return self.node_rows[self.token_node].to(torch.float64)

    def attended_pairs(self) -> int:
        """Query-key pairs of one attention layer: each node against its ancestors + causal self."""
        n, a = self.node_len.double(), self.node_depth.double()
        return int((n * a + n * (n + 1) / 2).sum().item())

    def chunk_segments(self, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """([M] c, [M] f, [M] first child or -1): the span [c, f) of path positions a chunked
        recurrent layer (gated DeltaNet, zorro_core.models.linear_layout) runs for each node, so that
        every span starts on a multiple of `chunk`: f = the node's end for a leaf, the last multiple
        of `chunk` within it for a node with children (whose children replay [f, end)); c = its
        parent's f (0 at a root). A node's first child is its lowest-numbered (packed order)."""
        m, dev = self.num_nodes, self.device
        end = self.node_depth + self.node_len
        parent = self.node_parent
        kids = (parent >= 0).nonzero().flatten()
        first_child = torch.full((m,), m, dtype=torch.long, device=dev).scatter_reduce(
            0, parent[kids], kids, "amin", include_self=True
        )
        has_child = first_child < m
        f = torch.where(has_child, end // chunk * chunk, end)
        c = torch.where(parent >= 0, f[parent.clamp(min=0)], 0)
        return c, f, torch.where(has_child, first_child, -1)


def check_sharing(sharing: str, min_shared_tokens: int) -> None:
    if sharing not in SHARINGS:
        raise ValueError(f"unknown sharing {sharing!r}; choose one of {SHARINGS}")
    if isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) or min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens must be an int >= 1, got {min_shared_tokens!r}")


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


def build_trie_plan(
    batch: RolloutBatch, vocab_size: Optional[int] = None, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS
) -> TriePlan:
    """The prefix-tree plan of a batch (see the module docstring); checks token ids against the vocabulary."""
    check_sharing("prefix", min_shared_tokens)
    if vocab_size is not None:  # the batch itself was validated when it was built
        batch.check_vocab(vocab_size)
    b, rw = batch.responses.shape
    canon, lens, plens = _rows_on_host(batch)
    start, end, parent, row_node = _radix_tree(canon, lens)
    keep = _prompt_closers(start, end, parent, row_node, plens)
    live = _merge_short(start, end, parent, row_node, min_shared_tokens, keep)
    packed, by_level, level, rows, first_row, tin, tout, prompt_tokens = _layout(
        start, end, parent, row_node, live, plens
    )
    nodes = _number_nodes(packed, start, end, parent, level, rows, first_row, tin, tout, row_node)
    token_node, position_ids, input_ids = _token_maps(nodes, canon)
    paths = _row_paths(nodes, lens)
    logit_index, labels, response_flat_index, response_logit = _shared_logprobs(batch, plens, paths)
    levels = _levels_on(_levels(by_level, nodes, paths.packed_at), batch.device)
    to = lambda x: x.to(batch.device)  # noqa: E731
    return TriePlan(
        batch_size=b,
        response_width=rw,
        min_shared_tokens=min_shared_tokens,
        node_depth=to(nodes.depth),
        node_len=to(nodes.length),
        node_start=to(nodes.start),
        node_parent=to(nodes.parent),
        node_level=to(nodes.level),
        node_rows=to(nodes.rows),
        node_tin=to(nodes.tin),
        node_tout=to(nodes.tout),
        row_node=to(nodes.row_node),
        input_ids=to(input_ids),
        position_ids=to(position_ids),
        token_node=to(token_node),
        logit_index=to(logit_index),
        labels=to(labels),
        response_flat_index=to(response_flat_index),
        response_logit=to(response_logit),
        levels=levels,
        logical_tokens=int(lens.sum()),
        logical_prompt_tokens=int(plens.sum()),
        unique_prompt_tokens=prompt_tokens,
    )


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
