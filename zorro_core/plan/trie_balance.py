"""Micro-batches of a `sharing="prefix"` batch, balanced by the prefix trie instead of by prompt.

A micro-batch runs its own trie plan (`build_trie_plan` of its rows), so a node shared by rows of
several micro-batches is computed once in each of them: a system prompt shared by every row costs
its tokens once per micro-batch, not once per group. The cost of a micro-batch is the cost model's
measure of its own plan (`tree_workload` of its nodes: tokens, plus `attention_weight` times the
query-key pairs of each node against its ancestors and causally itself), obtained from lengths
alone (`shared_nodes` over its sorted rows), so it equals what the micro-batch computes.

The rows sorted by tokens are the trie in depth-first order: every subtree is a run of them. A
micro-batch is a run: the union of its rows' paths then costs the first row's length plus, for
each next row, the tokens past those it shares with the previous one (`shared_depths`), a prefix
sum. Over the runs that fit the token budget (a single row over it stands alone, as in prompt
mode), a dynamic program picks the cut that minimises the summed cost (what gradient accumulation
runs), then fewer micro-batches, then the smaller largest one: a subtree stays whole where the
budget allows, and where one must be cut the cut is made where the rows share the fewest tokens.
The runs are checked against the budget on their own plans (folding short nodes with
`min_shared_tokens > 1` can make a sub-batch's plan differ from its share of the whole plan) and a
run over it is cut again. The prompt-group partition (`partition_micro_batches`, what
`sharing="prompt"` runs) is costed the same way, and the cheaper of the two is returned, so the
trie partition never costs more than grouping by prompt.

Host-side code on lengths only: the DP is O(B x rows per micro-batch), vectorised per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from zorro_core.plan.balance import GroupedLengths, Partition, partition_micro_batches
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.cost import ForwardWork, tree_workload
from zorro_core.plan.sharing import DEFAULT_MIN_SHARED_TOKENS, check_sharing
from zorro_core.plan.trie_radix import shared_depths, shared_nodes, sorted_rows


def _tri(n):
    """Pairs of n tokens at depths 0..n-1, each attending to its depth + 1 keys (ints or arrays)."""
    return n * (n + 1) // 2


@dataclass
class TrieLengths:
    """Lengths of a batch's rows in token order and what consecutive rows share in the trie."""

    order: list[int]
    """Row of the batch at each sorted position."""
    lens: list[int]
    """[B] real tokens of each sorted row."""
    prompt_lens: list[int]
    """[B] real prompt tokens of each sorted row."""
    lcp: list[int]
    """[B - 1] tokens sorted rows i and i + 1 have in common."""
    groups: GroupedLengths
    """The prompt grouping of the same rows (batch order): the prompt-mode partition's input."""
    min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS
    """The plans' min_shared_tokens (the micro-batches' plans fold short runs the same way)."""
    position: list[int] = field(init=False, repr=False)
    """[B] sorted position of each row of the batch."""
    shared: list[int] = field(init=False, repr=False)
    """[B - 1] tokens sorted rows i and i + 1 share in the whole batch's plan (`shared_depths`)."""

    def __post_init__(self) -> None:
        check_sharing("prefix", self.min_shared_tokens)
        b = len(self.order)
        if b == 0:
            raise ValueError("empty workload: no rows")
        if sorted(self.order) != list(range(b)) or len(self.groups.group_of_row) != b:
            raise ValueError("order must be a permutation of the rows of `groups`")
        if len(self.lens) != b or len(self.prompt_lens) != b or len(self.lcp) != b - 1:
            raise ValueError(f"{b} rows need {b} lengths, {b} prompt lengths and {b - 1} common prefixes")
        if any(not 1 <= p < n for p, n in zip(self.prompt_lens, self.lens)):
            raise ValueError("every row needs a prompt and a response token (1 <= prompt < length)")
        self.position = [0] * b
        for i, r in enumerate(self.order):
            self.position[r] = i
        self.shared = shared_depths(self.lens, self.lcp, self.prompt_lens, self.min_shared_tokens)

    @classmethod
    def of(cls, batch: RolloutBatch, min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS) -> "TrieLengths":
        rows = sorted_rows(batch)
        return cls(rows.order, rows.lens, rows.prompt_lens, rows.lcp, GroupedLengths.of(batch), min_shared_tokens)

    def work(self, rows: Sequence[int]) -> ForwardWork:
        """The cost model's workload of the plan of `rows` (batch indices): its own trie's nodes."""
        pos = sorted(self.position[r] for r in rows)
        return self._work_sorted(pos)

    def _work_sorted(self, pos: Sequence[int]) -> ForwardWork:
        # Rows a < b of the sorted order share min(lcp[a..b-1]) tokens (a sorted order's LCP property).
        lcp = [min(self.lcp[a:b]) for a, b in zip(pos, pos[1:])]
        depth, length = shared_nodes(
            [self.lens[i] for i in pos], lcp, [self.prompt_lens[i] for i in pos], self.min_shared_tokens
        )
        return tree_workload(list(zip(depth, length)), 0)

    def tokens(self, rows: Sequence[int]) -> int:
        """Tokens the plan of `rows` computes."""
        return self.work(rows).tokens

    def cost(self, rows: Sequence[int], attention_weight: float = 0.0) -> float:
        """tokens(rows) plus attention_weight times its plan's attended pairs per layer."""
        return _cost(self.work(rows), attention_weight)


def _cost(work: ForwardWork, attention_weight: float) -> float:
    return float(work.tokens) + attention_weight * work.attended_pairs if attention_weight else float(work.tokens)


def partition_trie_micro_batches(
    work: TrieLengths, max_tokens: Optional[int] = None, attention_weight: float = 0.0
) -> Partition:
    """Micro-batches of at most `max_tokens` computed tokens each, cut along the trie (module doc).

    `split_groups`: prompt groups spread over more than one micro-batch; `recomputed_prompt_tokens`:
    tokens computed beyond one plan of the whole batch (shared nodes computed once per micro-batch)."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    b = len(work.order)
    if max_tokens is None:
        return _finish(work, [list(range(b))], attention_weight, None)
    runs = [seg for run in _cheapest_runs(work, max_tokens, attention_weight) for seg in _fit(work, run, max_tokens)]
    trie = [[work.order[i] for i in run] for run in runs]
    by_prompt = partition_micro_batches(work.groups, max_tokens, attention_weight).parts
    fitted = [[work.order[i] for i in seg] for p in by_prompt for seg in _fit(work, _sorted(work, p), max_tokens)]
    return min(
        (_finish(work, parts, attention_weight, max_tokens) for parts in (trie, fitted)),
        key=lambda p: (sum(p.costs), len(p.parts), max(p.costs)),
    )


def _sorted(work: TrieLengths, rows: Sequence[int]) -> list[int]:
    return sorted(work.position[r] for r in rows)


def _cheapest_runs(work: TrieLengths, budget: int, attention_weight: float) -> list[list[int]]:
    """Runs of sorted positions: each within budget by the union of its paths in the whole batch's
    trie (or a single row), minimising (summed cost, runs, largest cost); ties: the later cut."""
    b = len(work.lens)
    lens = np.asarray(work.lens, dtype=np.int64)
    shared = np.asarray([0] + work.shared, dtype=np.int64)
    # What row i adds to a run holding row i - 1, summed: run s..e = lens[s] + sum[e] - sum[s].
    tok_sum = np.cumsum(np.where(np.arange(b) > 0, lens - shared, 0))
    pair_sum = np.cumsum(np.where(np.arange(b) > 0, _tri(lens) - _tri(shared), 0))
    first_tok, first_pairs = lens - tok_sum, _tri(lens) - pair_sum  # + sum[e]: the run s..e
    # best_*[e]: the best cut of positions 0..e-1; cut[e]: where its last run starts.
    best_sum, best_cnt, best_max = np.zeros(b + 1), np.zeros(b + 1, dtype=np.int64), np.zeros(b + 1)
    cut = np.zeros(b + 1, dtype=np.int64)
    lo = 0
    for e in range(b):
        while lo < e and first_tok[lo] + tok_sum[e] > budget:  # runs lo..e grow with e: lo only moves on
            lo += 1
        s = np.arange(lo, e + 1)
        cost = (first_tok[s] + tok_sum[e]).astype(np.float64)
        if attention_weight:
            cost = cost + attention_weight * (first_pairs[s] + pair_sum[e])
        key_sum, key_cnt, key_max = best_sum[s] + cost, best_cnt[s] + 1, np.maximum(best_max[s], cost)
        tie = key_sum == key_sum.min()
        tie &= key_cnt == key_cnt[tie].min()
        tie &= key_max == key_max[tie].min()
        j = int(np.flatnonzero(tie)[-1])
        best_sum[e + 1], best_cnt[e + 1], best_max[e + 1], cut[e + 1] = key_sum[j], key_cnt[j], key_max[j], lo + j
    runs, e = [], b
    while e:
        start = int(cut[e])
        runs.append(list(range(start, e)))
        e = start
    return runs[::-1]


def _fit(work: TrieLengths, pos: list[int], budget: int) -> list[list[int]]:
    """`pos` (sorted positions) cut into consecutive pieces whose own plans fit the budget (a single
    row over it alone): the longest fitting prefix, again and again (binary search, each end checked)."""
    if len(pos) == 1 or work._work_sorted(pos).tokens <= budget:
        return [pos]
    out, i = [], 0
    while i < len(pos):
        lo, hi = i + 1, len(pos)  # pos[i:lo] fits (or is one row)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if work._work_sorted(pos[i:mid]).tokens <= budget:
                lo = mid
            else:
                hi = mid - 1
        out.append(pos[i:lo])
        i = lo
    return out


def _finish(work: TrieLengths, parts: list[list[int]], attention_weight: float, budget: Optional[int]) -> Partition:
    measured = [(sorted(p), work.work(p)) for p in parts if p]
    cost = [_cost(w, attention_weight) for _, w in measured]
    order = sorted(range(len(measured)), key=lambda i: (-cost[i], measured[i][0][0]))
    gor = work.groups.group_of_row
    holders: dict[int, int] = {}
    for p, _ in measured:
        for g in {gor[r] for r in p}:
            holders[g] = holders.get(g, 0) + 1
    tokens = [measured[i][1].tokens for i in order]
    whole = work.work(range(len(work.order))).tokens
    return Partition(
        parts=[measured[i][0] for i in order],
        costs=[cost[i] for i in order],
        tokens=tokens,
        split_groups=sorted(g for g, n in holders.items() if n > 1),
        recomputed_prompt_tokens=sum(tokens) - whole,
        budget=budget,
        over_budget=[i for i, t in enumerate(tokens) if budget is not None and t > budget],
    )
