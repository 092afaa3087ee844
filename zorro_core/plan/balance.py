"""Micro-batches and data-parallel shards of a batch, balanced by a dedup-aware cost.

The unit of work is a group (rows sharing a prompt): its prompt is computed once, then each
response. For rows `rows` of a group with prompt length P and response lengths R_i:
    tokens = P + sum R_i
    cost   = tokens + attention_weight * (P(P+1)/2 + sum(R_i P + R_i(R_i+1)/2))
the second term counting the query-key pairs attention visits (0 by default: linear layers
dominate below a few thousand tokens).

Micro-batches (`partition_micro_batches`): a group whose tokens exceed the budget is split
on purpose into pieces (first-fit decreasing over its responses), and each piece recomputes
the prompt: a split costs (pieces - 1) * P extra tokens, reported as
`recomputed_prompt_tokens`. Pieces are balanced over k micro-batches with Karmarkar-Karp
(k-way largest differencing); k starts at ceil(tokens / budget) and grows until every
micro-batch fits (a bounded number of tries, then the k of a first-fit-decreasing packing,
then that packing itself, which always fits). Only a piece that alone exceeds the budget
(one prompt + one response longer than it) cannot fit anywhere: it is reported in
`over_budget`.

Data-parallel shards (`partition_ranks`): every rank gets the same number of rows. Groups
stay whole when the group sizes allow it (equal-count KK over groups); otherwise the better
of equal chunks (equal-count KK) and whole-groups-first with the rest cut into the rooms
left.
Host-side Python on lengths only: no model, no tensors beyond the grouping.
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import dataclass, field
from functools import reduce
from typing import Optional, Sequence

import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.cost import causal_pairs
from zorro_core.plan.prompt import group_rows


@dataclass
class GroupedLengths:
    """Lengths of a batch's rows and the group of each row (a prompt shared by content)."""

    group_of_row: list[int]
    """[B] group of each row, numbered from 0."""
    prompt_lens: list[int]
    """[G] real prompt tokens of each group."""
    response_lens: list[int]
    """[B] real response tokens of each row."""

    def __post_init__(self) -> None:
        b, g = len(self.group_of_row), len(self.prompt_lens)
        if b == 0:
            raise ValueError("empty workload: no rows")
        if len(self.response_lens) != b:
            raise ValueError(f"{b} rows in group_of_row but {len(self.response_lens)} response lengths")
        if sorted(set(self.group_of_row)) != list(range(g)):
            raise ValueError(f"group_of_row must use every group id 0..{g - 1} (one prompt length per group)")
        if min(self.prompt_lens) < 1 or min(self.response_lens) < 1:
            raise ValueError("prompt and response lengths must be >= 1")

    @classmethod
    def of(cls, batch: RolloutBatch, dedup: bool = True) -> "GroupedLengths":
        """The workload of a batch; `dedup=False` makes every row its own group (the baseline)."""
        gor = group_rows(batch, dedup).tolist()
        plen_row = batch.prompt_mask.bool().sum(1).tolist()
        plens = [0] * (max(gor) + 1)
        for row, g in enumerate(gor):
            plens[g] = plen_row[row]
        return cls(gor, plens, batch.response_mask.bool().sum(1).tolist())

    def subset(self, rows: Sequence[int]) -> "GroupedLengths":
        """The workload of `rows` (in that order), its groups renumbered from 0 by first appearance."""
        ids: dict[int, int] = {}
        gor = [ids.setdefault(self.group_of_row[r], len(ids)) for r in rows]
        plens = [0] * len(ids)
        for g, local in ids.items():
            plens[local] = self.prompt_lens[g]
        return GroupedLengths(gor, plens, [self.response_lens[r] for r in rows])

    @property
    def rows_of_group(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.prompt_lens]
        for row, g in enumerate(self.group_of_row):
            out[g].append(row)
        return out

    def tokens(self, rows: Sequence[int]) -> int:
        """Tokens a deduplicated forward over `rows` computes: each distinct prompt once."""
        groups = {self.group_of_row[r] for r in rows}
        return sum(self.prompt_lens[g] for g in groups) + sum(self.response_lens[r] for r in rows)

    def cost(self, rows: Sequence[int], attention_weight: float = 0.0) -> float:
        """tokens(rows) plus attention_weight times the query-key pairs attention visits."""
        if not attention_weight:
            return float(self.tokens(rows))
        groups = {self.group_of_row[r] for r in rows}
        pairs = sum(causal_pairs(p, p) for p in (self.prompt_lens[g] for g in groups))
        for r in rows:
            n, p = self.response_lens[r], self.prompt_lens[self.group_of_row[r]]
            pairs += causal_pairs(n, p + n)
        return self.tokens(rows) + attention_weight * pairs


@dataclass
class Partition:
    """Rows assigned to parts (micro-batches or ranks), with what the assignment costs."""

    parts: list[list[int]]
    """Row indices of each part, ascending."""
    costs: list[float]
    """Cost of each part (dedup-aware: a prompt counted once per part that holds its rows)."""
    tokens: list[int]
    """Tokens each part computes."""
    split_groups: list[int]
    """Groups whose rows are spread over more than one part."""
    recomputed_prompt_tokens: int
    """Extra prompt tokens because of splits: sum over groups of (parts holding it - 1) * P."""
    budget: Optional[int] = None
    """The token budget of a part, if any."""
    over_budget: list[int] = field(default_factory=list)
    """Parts above the budget (each one a single prompt + response that cannot fit)."""

    @property
    def imbalance(self) -> float:
        """max / mean cost over parts (1.0 is perfect)."""
        mean = sum(self.costs) / len(self.costs)
        # max >= mean exactly; the float sum can put the mean a rounding step above the max.
        return max(1.0, max(self.costs) / mean) if mean > 0 else 1.0


def _finish(work: GroupedLengths, parts: list[list[int]], attention_weight: float, budget: Optional[int]) -> Partition:
    parts = sorted((sorted(p) for p in parts if p), key=lambda p: (-work.cost(p, attention_weight), p[0]))
    holders: dict[int, int] = {}
    for p in parts:
        for g in {work.group_of_row[r] for r in p}:
            holders[g] = holders.get(g, 0) + 1
    split = sorted(g for g, n in holders.items() if n > 1)
    tokens = [work.tokens(p) for p in parts]
    over = [i for i, t in enumerate(tokens) if budget is not None and t > budget]
    return Partition(
        parts=parts,
        costs=[work.cost(p, attention_weight) for p in parts],
        tokens=tokens,
        split_groups=split,
        recomputed_prompt_tokens=sum((holders[g] - 1) * work.prompt_lens[g] for g in split),
        budget=budget,
        over_budget=over,
    )


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """k-way largest differencing: item indices of each of k parts.

    Each item starts as a partial partition (itself in one part, k-1 empty ones); the two
    partial partitions with the largest spread (max - min part sum) are merged by pairing the
    heaviest part of one with the lightest of the other, until one remains. With
    `equal_size`, items are first dealt k at a time (one per part, heaviest first), so every
    part ends with len(costs) / k items (which must divide evenly).
    """
    n = len(costs)
    if k < 1:
        raise ValueError(f"number of parts must be >= 1, got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal-size partition of {n} items into {k} parts is impossible")
    order = sorted(range(n), key=lambda i: -costs[i])
    if equal_size:
        seeds = [[(costs[i], [i]) for i in order[s : s + k]] for s in range(0, n, k)]
    else:
        seeds = [[(costs[i], [i])] + [(0.0, [])] * (k - 1) for i in order]
    heap: list[tuple] = []
    for tick, parts in enumerate(seeds):
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), tick, parts))
    tick = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tick, merged))
        tick += 1
    return [items for _, items in heap[0][2]] if heap else [[] for _ in range(k)]


def greedy_partition(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """The baseline: heaviest item first into the lightest part (LPT), optionally equal counts."""
    if k < 1:
        raise ValueError(f"number of parts must be >= 1, got {k}")
    if equal_size and len(costs) % k:
        raise ValueError(f"equal-size partition of {len(costs)} items into {k} parts is impossible")
    cap = len(costs) // k if equal_size else len(costs)
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0.0] * k
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        j = min((j for j in range(k) if len(parts[j]) < cap), key=lambda j: sums[j])
        parts[j].append(i)
        sums[j] += costs[i]
    return parts


_BALANCERS = {"kk": karmarkar_karp, "greedy": greedy_partition}
_MAX_TRIES = 16
"""Balanced partitions tried per micro-batch plan before falling back to first-fit decreasing."""


def _split_group(work: GroupedLengths, g: int, rows: list[int], budget: int) -> list[list[int]]:
    """Pieces of a group that fit the budget (first-fit decreasing); an unfittable row stays alone."""
    sizes = [work.response_lens[r] for r in rows]
    return [[rows[i] for i in b] for b in _first_fit_decreasing(sizes, budget - work.prompt_lens[g])]


def check_attention_weight(attention_weight: object) -> None:
    """ValueError unless `attention_weight` is a finite number >= 0 (not a bool, not a string)."""
    if (
        isinstance(attention_weight, bool)
        or not isinstance(attention_weight, numbers.Real)
        or not math.isfinite(attention_weight)
        or attention_weight < 0
    ):
        raise ValueError(
            f"attention_weight must be a finite number >= 0, got {type(attention_weight).__name__} {attention_weight!r}"
        )


def partition_micro_batches(
    work: GroupedLengths,
    max_tokens: Optional[int] = None,
    attention_weight: float = 0.0,
    min_micro_batches: int = 1,
    balance: str = "kk",
) -> Partition:
    """Micro-batches of at most `max_tokens` computed tokens each, balanced by cost (module doc)."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if min_micro_batches < 1:
        raise ValueError(f"min_micro_batches must be >= 1, got {min_micro_batches}")
    if balance not in _BALANCERS:
        raise ValueError(f"unknown balance {balance!r}; choose one of {sorted(_BALANCERS)}")
    pieces: list[list[int]] = []
    for g, rows in enumerate(work.rows_of_group):
        if max_tokens is None or work.tokens(rows) <= max_tokens:
            pieces.append(rows)
        else:
            pieces.extend(_split_group(work, g, rows, max_tokens))
    costs = [work.cost(p, attention_weight) for p in pieces]
    total = sum(work.tokens(p) for p in pieces)
    k = max(min_micro_batches, 1 if max_tokens is None else math.ceil(total / max_tokens))
    k = min(k, len(pieces))
    if max_tokens is None:
        return _finish(work, _assemble(pieces, _BALANCERS[balance](costs, k)), attention_weight, None)
    # First-fit decreasing by tokens always fits (k_fit bins); try balanced partitions from the
    # lower bound up (a bounded number of tries: each costs O(pieces x k)), then k_fit itself.
    fit = _first_fit_decreasing([work.tokens(p) for p in pieces], max_tokens)
    k_fit = max(len(fit), min(min_micro_batches, len(pieces)))
    tries = sorted(set(range(k, min(k + _MAX_TRIES, k_fit))) | {k_fit})
    for k in tries:
        assign = _BALANCERS[balance](costs, k)
        parts = _assemble(pieces, assign)
        # Feasible when every part over the budget is a single piece that cannot fit anywhere.
        if all(work.tokens(p) <= max_tokens or len(items) == 1 for p, items in zip(parts, assign)):
            return _finish(work, parts, attention_weight, max_tokens)
    return _finish(work, _assemble(pieces, fit), attention_weight, max_tokens)


def _assemble(pieces: list[list[int]], assign: list[list[int]]) -> list[list[int]]:
    return [[r for i in items for r in pieces[i]] for items in assign]


def _first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each within capacity (an item above it alone in its bin)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = next((j for j, left in enumerate(room) if sizes[i] <= left), None)
        if j is None:
            bins.append([i])
            room.append(capacity - sizes[i])
        else:
            bins[j].append(i)
            room[j] -= sizes[i]
    return bins


def partition_ranks(
    work: GroupedLengths,
    world_size: int,
    attention_weight: float = 0.0,
    balance: str = "kk",
    bounded_splits: bool = False,
) -> Partition:
    """Rows for each of `world_size` ranks, the same number each, balanced by cost.

    `bounded_splits`: the prompts recomputed because of splits stay at most world_size - 1 (each
    boundary between ranks cuts at most one group); the equal-chunks candidate is then taken
    only when it splits no more than that.

    Two candidates, the one with the lower maximum cost wins:
    - equal chunks: units of u consecutive rows of a group, u the largest divisor of the gcd
      of the group sizes with (B / u) divisible by world_size, balanced by `balance` with
      equal unit counts. u = group size (groups whole) when the groups divide evenly.
    - whole groups first: heaviest group first into the least-loaded rank with room for all
      its rows; groups that fit nowhere are cut into the largest rooms left (the prompt then
      recomputed on each rank holding a piece).
      Each piece but a group's last fills its room, so at most world_size - 1 prompts are
      recomputed.
    """
    b = len(work.group_of_row)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if b % world_size:
        raise ValueError(f"{b} rows cannot be shared equally by {world_size} ranks")
    if balance not in _BALANCERS:
        raise ValueError(f"unknown balance {balance!r}; choose one of {sorted(_BALANCERS)}")
    groups = work.rows_of_group
    gcd = reduce(math.gcd, (len(rows) for rows in groups))
    u = max(d for d in range(1, gcd + 1) if gcd % d == 0 and (b // d) % world_size == 0)
    units = [rows[s : s + u] for rows in groups for s in range(0, len(rows), u)]
    assign = _BALANCERS[balance]([work.cost(x, attention_weight) for x in units], world_size, equal_size=True)
    chunks = _finish(work, [[r for i in items for r in units[i]] for items in assign], attention_weight, None)
    if not chunks.split_groups:
        return chunks
    whole = _finish(work, _whole_groups_first(work, world_size, attention_weight), attention_weight, None)
    if bounded_splits and extra_pieces(work, chunks) > world_size - 1:
        return whole
    return min((chunks, whole), key=lambda p: (max(p.costs), p.recomputed_prompt_tokens))


def extra_pieces(work: GroupedLengths, partition: Partition) -> int:
    """Prompts computed more than once because their group is split: sum of (parts holding it - 1)."""
    return sum(len({work.group_of_row[r] for r in p}) for p in partition.parts) - len(work.prompt_lens)


def _whole_groups_first(work: GroupedLengths, world_size: int, attention_weight: float) -> list[list[int]]:
    room = [len(work.group_of_row) // world_size] * world_size
    parts: list[list[int]] = [[] for _ in range(world_size)]
    load = [0.0] * world_size
    cut: list[list[int]] = []
    for rows in sorted(work.rows_of_group, key=lambda r: -work.cost(r, attention_weight)):
        fits = [j for j in range(world_size) if room[j] >= len(rows)]
        if not fits:
            cut.append(rows)
            continue
        j = min(fits, key=lambda j: load[j])
        parts[j] += rows
        room[j] -= len(rows)
        load[j] = work.cost(parts[j], attention_weight)
    for rows in cut:
        rows = sorted(rows, key=lambda r: -work.response_lens[r])
        while rows:
            j = max(range(world_size), key=lambda j: (room[j], -load[j]))
            take, rows = rows[: room[j]], rows[room[j] :]
            parts[j] += take
            room[j] -= len(take)
            load[j] = work.cost(parts[j], attention_weight)
    return parts


def select_rows(batch: RolloutBatch, rows: torch.Tensor | Sequence[int]) -> RolloutBatch:
    """The sub-batch of `rows` (in that order), prompt padding columns no row needs removed.

    Response width is kept, so [b, R] results line up with the full batch's columns.
    """
    idx = torch.as_tensor(rows, dtype=torch.long, device=batch.device)
    if idx.dim() != 1 or idx.numel() == 0:
        raise ValueError(f"rows must be a non-empty 1-D list of row indices, got shape {tuple(idx.shape)}")
    if int(idx.min()) < 0 or int(idx.max()) >= batch.batch_size:
        raise ValueError(f"row index out of range for a batch of {batch.batch_size} rows")
    pm = batch.prompt_mask[idx]
    width = int(pm.bool().sum(1).max())
    cut = pm.shape[1] - width
    # Rows of a validated batch, leading all-padding prompt columns cut: still valid, not checked again.
    return RolloutBatch.of_validated(
        batch.prompts[idx, cut:], pm[:, cut:], batch.responses[idx], batch.response_mask[idx]
    )
