"""Where each row of a data-parallel batch goes: whole prompts on one rank, ranks balanced.

Pure host-side Python on the rows' metadata (prompt key, prompt and response lengths) of every
rank; every rank computes the same routing from the same gathered metadata, so no rank has to
decide for the others. Rows are numbered rank-major (rank 0's rows, then rank 1's, ...).

Partition (dedup-aware cost of zorro_core.plan.balance, Karmarkar-Karp):
- `equal_rows=False` (default): whole groups, balanced over the ranks by cost. When there are
  fewer groups than ranks, the largest groups are halved until every rank can get a piece (the
  prompt is then computed once per rank holding a piece).
- `equal_rows=True`: the same number of rows per rank (`partition_ranks`): groups stay whole
  when their sizes allow it.
Parts are then given to ranks so that as many rows as possible (weighted by tokens) stay where
they are: those are not sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zorro_core.plan.balance import GroupedLengths, karmarkar_karp, partition_ranks


@dataclass
class Routing:
    """The destination rank of every row of the global (rank-major) batch."""

    world_size: int
    rows_before: list[int]
    """Rows each rank holds before regrouping."""
    dest: list[int]
    """[N] destination rank of each global row."""
    work: GroupedLengths
    """The global workload (groups by prompt key, lengths) the partition balanced."""

    def offset(self, rank: int) -> int:
        """Global index of `rank`'s first row."""
        return sum(self.rows_before[:rank])

    def rows_on(self, rank: int, after: bool = True) -> list[int]:
        """Global rows `rank` holds after (or before) regrouping, ascending: its local order."""
        if after:
            return [row for row, d in enumerate(self.dest) if d == rank]
        start = self.offset(rank)
        return list(range(start, start + self.rows_before[rank]))

    @property
    def rows_after(self) -> list[int]:
        return [len(self.rows_on(r)) for r in range(self.world_size)]

    def tokens(self, after: bool = True) -> list[int]:
        """Tokens each rank computes (each of its distinct prompts once), after or before."""
        return [self.work.tokens(self.rows_on(r, after)) for r in range(self.world_size)]

    def prompt_dedup_ratio(self, after: bool = True) -> list[float]:
        """Per rank: 1 - unique prompt tokens / all prompt tokens of its rows."""
        out = []
        for r in range(self.world_size):
            rows = self.rows_on(r, after)
            plens = [self.work.prompt_lens[self.work.group_of_row[i]] for i in rows]
            unique = sum(self.work.prompt_lens[g] for g in {self.work.group_of_row[i] for i in rows})
            out.append(1.0 - unique / sum(plens))
        return out

    def split_groups(self, after: bool = True) -> int:
        """Groups whose rows sit on more than one rank."""
        holders: dict[int, set[int]] = {}
        for r in range(self.world_size):
            for i in self.rows_on(r, after):
                holders.setdefault(self.work.group_of_row[i], set()).add(r)
        return sum(len(h) > 1 for h in holders.values())


def plan_routing(
    keys: Sequence[Sequence[int]],
    prompt_lens: Sequence[Sequence[int]],
    response_lens: Sequence[Sequence[int]],
    equal_rows: bool = False,
    attention_weight: float = 0.0,
) -> Routing:
    """The routing of a batch held by len(keys) ranks; row i of rank r has key keys[r][i], etc.

    Rows with equal keys form a group (one prompt). Every rank gets at least one row.
    """
    world = len(keys)
    if world < 1:
        raise ValueError("no ranks")
    if not (len(prompt_lens) == len(response_lens) == world):
        raise ValueError("keys, prompt_lens and response_lens need one entry per rank")
    rows_before = [len(k) for k in keys]
    for r in range(world):
        if rows_before[r] < 1:
            raise ValueError(f"rank {r} holds no rows: every rank must pass a non-empty batch")
        if not (len(prompt_lens[r]) == len(response_lens[r]) == rows_before[r]):
            raise ValueError(
                f"rank {r}: {rows_before[r]} keys but {len(prompt_lens[r])} prompt lengths "
                f"and {len(response_lens[r])} response lengths"
            )
    n = sum(rows_before)
    if n < world:
        raise ValueError(f"{n} rows cannot give each of {world} ranks a row")
    flat_keys = [k for ks in keys for k in ks]
    ids: dict[int, int] = {}
    group_of_row = [ids.setdefault(k, len(ids)) for k in flat_keys]
    plens = [0] * len(ids)
    for g, p in zip(group_of_row, (p for ps in prompt_lens for p in ps)):
        plens[g] = p
    work = GroupedLengths(group_of_row, plens, [x for xs in response_lens for x in xs])
    if equal_rows:
        parts = partition_ranks(work, world, attention_weight).parts
    else:
        parts = _whole_groups(work, world, attention_weight)
    if len(parts) != world or not all(parts):
        raise AssertionError(f"partition gave {[len(p) for p in parts]} rows to {world} ranks")
    rows_before_of = [r for r in range(world) for _ in range(rows_before[r])]
    dest = [0] * n
    for part, rank in zip(parts, _assign_parts(work, parts, rows_before_of, world)):
        for row in part:
            dest[row] = rank
    return Routing(world, rows_before, dest, work)


def _whole_groups(work: GroupedLengths, world: int, attention_weight: float) -> list[list[int]]:
    units = [rows for rows in work.rows_of_group]
    while len(units) < world:  # fewer groups than ranks: halve the costliest divisible unit
        i = max((i for i, u in enumerate(units) if len(u) > 1), key=lambda i: work.cost(units[i], attention_weight))
        units[i : i + 1] = [units[i][: len(units[i]) // 2], units[i][len(units[i]) // 2 :]]
    assign = karmarkar_karp([work.cost(u, attention_weight) for u in units], world)
    return [sorted(r for i in items for r in units[i]) for items in assign]


def _assign_parts(work: GroupedLengths, parts: list[list[int]], source: list[int], world: int) -> list[int]:
    """The rank of each part: greedy on the tokens a rank already holds of a part (kept, not sent)."""

    def row_tokens(row: int) -> int:
        return work.prompt_lens[work.group_of_row[row]] + work.response_lens[row]

    kept = [[0] * world for _ in parts]
    for p, part in enumerate(parts):
        for row in part:
            kept[p][source[row]] += row_tokens(row)
    pairs = sorted(
        ((kept[p][r], p, r) for p in range(len(parts)) for r in range(world)), key=lambda x: (-x[0], x[1], x[2])
    )
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, p, r in pairs:
        if p not in rank_of and r not in taken:
            rank_of[p] = r
            taken.add(r)
    return [rank_of[p] for p in range(len(parts))]
