"""Whole prompt groups on each data-parallel rank and mini-batch, balanced by what zorro computes.

The balance verl's trainer (`zorro_core.integrations.verl.balance`) and OpenRLHF's batching
(`zorro_core.integrations.openrlhf.batching`) share: rows are given to ranks as whole groups,
each rank the same number of rows, balanced by zorro's cost (a group's prompt once plus its
responses, `zorro_core.plan.balance`), and each rank's rows placed so that its mini-batches hold
whole groups too. Where sizes force a split, every boundary between two (rank, mini-batch) slots
cuts at most one group; the split groups and their ranks are reported. Pure host-side Python on
the rows' lengths: no trainer is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from zorro_core.plan.balance import GroupedLengths, partition_ranks

__all__ = ["ATTENTION_WEIGHT", "Balance", "balance_rows"]

ATTENTION_WEIGHT = 2 / 24576
"""Attention's query-key pairs per linear token, as verl's `calculate_workload` (24576 s + s^2,
a 7B model) weighs them: s^2 = 2 x the s(s+1)/2 causal pairs."""


@dataclass
class Balance:
    """Rows in the order a trainer's dispatch splits them (verl's: contiguous equal chunks): rank 0's first,
    each rank's by mini-batch."""

    order: list[int]
    """Row indices in dispatch order (feed to `KVBatchMeta.reorder`)."""
    ranks: list[list[int]]
    """Row indices each rank receives, in order."""
    slots: int
    """Mini-batches per rank that groups are kept inside (1: the rank's rows as a whole)."""
    costs: list[float]
    """zorro's cost of each rank (prompt once per (rank, mini-batch) slot holding its rows)."""
    prompt_dedup: list[float]
    """Per rank: 1 - prompt tokens computed / prompt tokens of its rows."""
    batch_prompt_dedup: float
    """The same over the whole batch, each group's prompt once: what the ranks can reach."""
    split: dict[int, list[int]] = field(default_factory=dict)
    """Group -> ranks holding its rows, for each group not whole in one slot."""

    @property
    def imbalance(self) -> float:
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean > 0 else 1.0


def _slot_cost(work: GroupedLengths, rows: Sequence[int]) -> float:
    return work.cost(rows, ATTENTION_WEIGHT) if rows else 0.0


def _dedup(work: GroupedLengths, rows_by_slot: Sequence[Sequence[int]]) -> float:
    logical = sum(work.prompt_lens[work.group_of_row[r]] for rows in rows_by_slot for r in rows)
    computed = sum(sum(work.prompt_lens[g] for g in {work.group_of_row[r] for r in rows}) for rows in rows_by_slot)
    return 1.0 - computed / logical if logical else 0.0


def _split(work: GroupedLengths, rows: list[int], parts: int) -> list[list[int]]:
    """`rows` into `parts` equal row counts, whole groups where sizes allow (<= parts - 1 cuts)."""
    if parts == 1:
        return [sorted(rows, key=lambda r: (work.group_of_row[r], r))]
    sub = work.subset(rows)
    p = partition_ranks(sub, parts, attention_weight=ATTENTION_WEIGHT, bounded_splits=True)
    # partition_ranks sorts parts by cost; any order of equal-sized parts is a valid split, and the
    # heaviest first keeps rank 0 (the rank trainers' logs read) representative.
    return [sorted((rows[i] for i in part), key=lambda r: (work.group_of_row[r], r)) for part in p.parts]


def balance_rows(
    group_of_row: Sequence[int],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    dp_size: int,
    mini_batch_rows: Optional[int] = None,
) -> Balance:
    """The order of rows for `dp_size` ranks (module doc).

    `group_of_row` numbers groups 0..G-1; `prompt_lens[i]`, `response_lens[i]` are row i's. With
    `mini_batch_rows` (the rows of one PPO mini-batch on one rank), the rows of each rank are
    also placed so that every mini-batch holds whole groups where sizes allow.
    """
    b = len(group_of_row)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if b % dp_size:
        raise ValueError(
            f"{b} rows cannot be shared equally by {dp_size} ranks (a trainer pads the batch first: verl upsamples)"
        )
    per_rank = b // dp_size
    slots = 1
    if mini_batch_rows is not None:
        if mini_batch_rows < 1 or per_rank % mini_batch_rows:
            raise ValueError(f"{per_rank} rows per rank are not a whole number of mini-batches of {mini_batch_rows}")
        slots = per_rank // mini_batch_rows
    ids: dict[int, int] = {}
    gor = [ids.setdefault(int(g), len(ids)) for g in group_of_row]
    plens = [0] * len(ids)
    for r, g in enumerate(gor):
        plens[g] = max(plens[g], int(prompt_lens[r]), 1)
    # A response of 0 tokens still occupies a row; cost it as one token (GroupedLengths needs >= 1).
    work = GroupedLengths(gor, plens, [max(1, int(n)) for n in response_lens])
    # Mini-batch k of every rank is one global mini-batch: first the rows of each global
    # mini-batch, then those rows over the ranks. Each level cuts at most one group per boundary.
    by_rank: list[list[list[int]]] = [[] for _ in range(dp_size)]
    for mini in _split(work, list(range(b)), slots):
        for rank, rows in enumerate(_split(work, mini, dp_size)):
            by_rank[rank].append(rows)
    holders: dict[int, set[int]] = {}
    pieces: dict[int, int] = {}
    for rank, slots_rows in enumerate(by_rank):
        for rows in slots_rows:
            for g in {gor[r] for r in rows}:
                holders.setdefault(g, set()).add(rank)
                pieces[g] = pieces.get(g, 0) + 1
    ranks = [[r for rows in slots_rows for r in rows] for slots_rows in by_rank]
    return Balance(
        order=[r for rows in ranks for r in rows],
        ranks=ranks,
        slots=slots,
        costs=[sum(_slot_cost(work, rows) for rows in slots_rows) for slots_rows in by_rank],
        prompt_dedup=[_dedup(work, slots_rows) for slots_rows in by_rank],
        batch_prompt_dedup=_dedup(work, [list(range(b))]),
        split={g: sorted(holders[g]) for g in sorted(pieces) if pieces[g] > 1},
    )
