"""The prompt-once schedule's phase-1 layout: the step's unique prompts as nodes, packed in one row.

One node per prompt (sharing="prompt"), or the prompts' radix trie (sharing="prefix"): a prefix
several prompts share is one node, computed once, and a prompt that is a prefix of another ends at
a node boundary. Nodes are packed depth-first, each node's tokens at their path positions; a token
attends to its node's whole root-to-node path (zorro_core.attention.external, KeyRegion.ancestors).
Every common prefix is a node whatever its length (`min_shared_tokens` does not apply here).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zorro_core.plan.trie_radix import radix_tree_of


@dataclass(frozen=True)
class PromptNodes:
    """What phase 1 computes: the unique prompts as nodes, one per prompt (sharing="prompt") or
    their radix trie (sharing="prefix": a prefix several prompts share is one node, computed once;
    a prompt that is a prefix of another ends at a node boundary). Packed in depth-first order,
    each node's tokens at their path positions."""

    ids: torch.Tensor
    """[Tp] packed token ids."""
    positions: torch.Tensor
    """[Tp] each token's position along its path."""
    token_node: torch.Tensor
    """[Tp] the node of each packed token."""
    node_span: list[tuple[int, int]]
    """Node -> its [start, end) in the packed row."""
    ancestors: torch.Tensor
    """[N, N] bool: node a is an ancestor-or-self of node n (the identity for sharing="prompt")."""
    end_node: list[int]
    """Unique prompt -> the node it ends in."""
    rank: list[int]
    """Unique prompt -> its end node's depth-first rank (rows run in this order: a micro-batch's
    prompts then share their paths' nodes)."""
    trie: bool
    """Whether the nodes are a prefix trie (else each prompt is its own root)."""

    @classmethod
    def of(cls, prompts: list[list[int]], sharing: str, device: torch.device) -> "PromptNodes":
        if sharing == "prefix":
            start, end, parent, end_node = radix_tree_of(prompts)
        else:
            start, end, parent, end_node = [0] * len(prompts), [len(p) for p in prompts], [-1] * len(prompts), []
            end_node = list(range(len(prompts)))
        n = len(start)
        children: list[list[int]] = [[] for _ in range(n)]
        roots: list[int] = []
        for x, p in enumerate(parent):
            (children[p] if p >= 0 else roots).append(x)
        rep = [-1] * n  # a prompt through each node: its tokens are the node's
        for g, e in enumerate(end_node):
            x = e
            while x >= 0 and rep[x] < 0:
                rep[x], x = g, parent[x]
        order, stack = [], list(reversed(roots))
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(reversed(children[x]))
        anc = torch.zeros(n, n, dtype=torch.bool)
        for x in range(n):
            y = x
            while y >= 0:
                anc[y, x], y = True, parent[y]
        ids: list[int] = []
        pos: list[int] = []
        tok_node: list[int] = []
        span, at = [(0, 0)] * n, 0
        for x in order:
            ids += prompts[rep[x]][start[x] : end[x]]
            pos += range(start[x], end[x])
            tok_node += [x] * (end[x] - start[x])
            span[x] = (at, at + end[x] - start[x])
            at += end[x] - start[x]
        tin = {x: i for i, x in enumerate(order)}
        t = functools.partial(torch.tensor, dtype=torch.long, device=device)
        return cls(
            t(ids), t(pos), t(tok_node), span, anc.to(device), end_node, [tin[e] for e in end_node], sharing == "prefix"
        )
