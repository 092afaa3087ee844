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

The jobs, one module each: the trie itself (zorro_core.plan.trie_radix), its nodes on the packed row
(zorro_core.plan.trie_pack), its split-mode calls per level (zorro_core.plan.trie_levels); this
module is the plan they make up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.protocol import PackedPlan
from zorro_core.plan.segments import Segments
from zorro_core.plan.sharing import DEFAULT_MIN_SHARED_TOKENS, SHARINGS, check_sharing
from zorro_core.plan.trie_levels import TreeLevel, _levels, _levels_on
from zorro_core.plan.trie_pack import _layout, _number_nodes, _row_paths, _shared_logprobs, _token_maps
from zorro_core.plan.trie_radix import (
    SortedRows,
    _merge_short,
    _prompt_closers,
    _radix_tree,
    _rows_on_host,
    shared_depths,
    shared_nodes,
    sorted_rows,
)

__all__ = [
    "DEFAULT_MIN_SHARED_TOKENS",
    "SHARINGS",
    "SortedRows",
    "TreeLevel",
    "TriePlan",
    "build_trie_plan",
    "check_sharing",
    "shared_depths",
    "shared_nodes",
    "sorted_rows",
]


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
