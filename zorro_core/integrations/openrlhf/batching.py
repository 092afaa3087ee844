"""Whole prompt groups in OpenRLHF 0.11's own batching: per data-parallel rank and per micro-batch.

OpenRLHF forms every batch its actor sees before the actor is called, so `DedupActor` alone can
share a prompt only among the siblings that batching happened to put together. Where OpenRLHF forms
them, and what replaces each here (`install()` in `zorro_core.integrations.openrlhf` registers them):

- log-prob calls (old and reference log-probs): `RemoteExperienceMaker.split_rollout_samples` cuts the
  rollout into micro-batches (fixed: contiguous chunks of `rollout.micro_batch_size` rows; dynamic:
  `get_seqlen_balanced_partitions` over total lengths, which scatters siblings), and
  `RayActorGroup.async_run_method_batch` gives each rank a contiguous chunk of them.
  `split_rollout_samples` here: whole groups per rank (the same number of rows each, balanced by
  zorro's cost) and per micro-batch, each rank the same number of micro-batches, laid out so that
  the contiguous chunks are those ranks.
- the training rows of each rank: with dynamic batching `balance_experiences` (sort by length,
  interleave across ranks); here `balance_experiences` gives whole groups to ranks and, within a
  rank, whole groups to each optimizer step's `train.batch_size / dp` rows (the slices
  `NaiveReplayBuffer.setup_dynamic_batch` cuts).
- training micro-batches (`ActorPPOTrainer.ppo_train`): fixed batching shuffles the replay buffer's
  rows (a `DataLoader` with `shuffle=True`); dynamic batching partitions each step's rows by length.
  `GroupedReplayBuffer` (a `NaiveReplayBuffer`): fixed: groups shuffled whole, then cut into
  micro-batches of `train.micro_batch_size` rows (the DataLoader then shuffles those micro-batches);
  dynamic: OpenRLHF's own `setup_dynamic_batch` (its optimizer steps and each step's loss
  normalisation), then each step's rows re-partitioned into micro-batches of whole groups, as many as
  zorro needs under the budget (the maximum over the ranks, all-reduced as OpenRLHF all-reduces its
  own count), balanced by zorro's cost, and the per-micro-batch loss scale (`len(partition) / rows of
  the step`) recomputed for the new partition.

A group costs its prompt once plus its responses (`zorro_core.plan.balance`, with the attention term
of `zorro_core.integrations.rank_balance.ATTENTION_WEIGHT`). Where sizes do not divide, a boundary between two ranks or two
micro-batches cuts at most one group; the split groups are counted (`BatchingRecord.split_groups`).
Token budgets of dynamic batching (`max_tokens_per_gpu`) count the tokens zorro computes (each
prompt once per micro-batch).

What the PPO step computes is unchanged: every row is trained once per epoch, advantages and rewards
travel with their rows (OpenRLHF keys its reward grouping on `Experience.index`, which is kept),
the loss normalisation (`get_loss_batch_info`, `iter_grad_accum_global_norm`) sums over the same
rows per optimizer step in fixed batching when groups divide the micro-batches, and in dynamic
batching per step always. Only which rows share a micro-batch (and, across steps, which share an
optimizer step) changes.

Served by OpenRLHF's own function, with a one-time `DedupFallbackWarning` naming the reason (and
counted in `BATCHING.fallback`): ring attention (`ds.ring_attn_size > 1`), dynamic log-prob micro-batches
when a reward model is computed in the trainer (OpenRLHF's `RewardModelActor` runs the same micro-batches,
every row whole, and zorro does not serve it), rows that cannot be split
into prompt and response (no `action_mask`, no scored token, another layout: `rows.split_rows`),
row counts that do not divide over the ranks or micro-batches as the plan needs.
"""

from __future__ import annotations

# Whole over ~450 lines: every place OpenRLHF forms a batch (log-prob calls, balance, replay buffer) reads one
# GroupedLengths and one refusal path; apart, the three would drift from the same grouping rule.
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from zorro_core.integrations.core import Fallback
from zorro_core.integrations.openrlhf.rows import split_rows
from zorro_core.integrations.rank_balance import ATTENTION_WEIGHT, balance_rows
from zorro_core.integrations.requires import require_trainer
from zorro_core.plan.balance import GroupedLengths, partition_micro_batches, partition_ranks

# Before any of OpenRLHF's names is imported (an older release lacks them), as integrations.openrlhf does.
require_trainer("openrlhf", __name__, "openrlhf", "OpenRLHF 0.11", minimum="0.11")
from openrlhf.trainer.ppo_utils.experience import (  # noqa: E402
    Experience,
    make_experience_batch,
    split_experience_batch,
)
from openrlhf.trainer.ppo_utils.experience import balance_experiences as openrlhf_balance_experiences  # noqa: E402
from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer  # noqa: E402
from openrlhf.utils.seqlen_balancing import get_seqlen_balanced_partitions  # noqa: E402
from openrlhf.utils.utils import zero_pad_sequences  # noqa: E402

__all__ = [
    "BATCHING",
    "BatchingRecord",
    "GroupedReplayBuffer",
    "balance_experiences",
    "budget_micro_batches",
    "equal_micro_batches",
    "fixed_micro_batches",
    "grouped_lengths",
    "rank_rows",
    "rollout_micro_batches",
    "split_rollout_samples",
]


@dataclass
class BatchingRecord:
    """What zorro's batching did in this process (the logger reads it: `status`)."""

    fallback: Fallback = field(default_factory=lambda: Fallback("OpenRLHF's own batching forms this batch"))
    """Batchings formed by zorro ("dedup") and handed back to OpenRLHF ("fallback"), with reasons."""
    split_groups: int = 0
    """Groups cut across two ranks or micro-batches (sizes that do not divide), since the last report."""
    micro_batch_dedup: list[float] = field(default_factory=list)
    """Prompt dedup each micro-batch formed here can reach (1 - distinct prompt tokens / prompt tokens)."""

    _reported: tuple[int, int, dict[str, int]] = (0, 0, {})

    def report(self) -> dict[str, Any]:
        """Since the last report: batchings formed ("dedup") and handed back ("fallback"), fallback
        reasons, split groups, the mean prompt dedup of the micro-batches formed; then a reset."""
        dedup, fallback, reasons = self._reported
        counts, now = self.fallback.counts, self.fallback.reasons
        out = {
            "dedup": counts["dedup"] - dedup,
            "fallback": counts["fallback"] - fallback,
            "reasons": {r: n - reasons.get(r, 0) for r, n in now.items() if n > reasons.get(r, 0)},
            "split_groups": self.split_groups,
            "micro_batch_dedup": list(self.micro_batch_dedup),
        }
        self._reported = (counts["dedup"], counts["fallback"], dict(now))
        self.split_groups, self.micro_batch_dedup = 0, []
        return out


BATCHING = BatchingRecord()
"""This process's record (a Ray worker is one process: one trainer or one model actor)."""


def _rows(item: Experience) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(sequence, attention mask, action mask) of each row of an Experience, 1-D each."""
    seq, att, act = item.sequences, item.attention_mask, item.action_mask
    if seq is None or att is None or act is None:
        raise _Refused("an Experience without sequences, attention_mask or action_mask")
    if seq.dim() == 1:
        return [(seq, att, act)]
    return [(seq[i], att[i], act[i]) for i in range(seq.shape[0])]


class _Refused(Exception):
    """zorro cannot group these rows: OpenRLHF's batching runs, with this reason."""


def grouped_lengths(items: Sequence[Experience]) -> GroupedLengths:
    """The group (prompt content), prompt length and response length of every row of `items`, in order.

    A row's prompt is its real tokens before its first scored token (the split `DedupActor` makes:
    `rows.split_rows`), its response the real tokens from there on. Raises `_Refused` with the
    reason when a row does not split.
    """
    rows = [r for item in items for r in _rows(item)]
    if not rows:
        raise _Refused("no rows")
    # Right padding, as OpenRLHF's make_experience_batch stacks single-sample experiences.
    seq = zero_pad_sequences([r[0] for r in rows], "right", stack=True)
    att = zero_pad_sequences([r[1] for r in rows], "right", stack=True)
    act = zero_pad_sequences([r[2] for r in rows], "right", stack=True)
    split = split_rows(att, act)
    if isinstance(split, str):
        raise _Refused(f"rows zorro cannot split into prompt and response: {split}")
    if split.live.numel() != len(rows):
        dead = sorted(set(range(len(rows))) - set(split.live.tolist()))
        raise _Refused(f"rows {dead[:5]} have no scored token (action_mask 0 everywhere)")
    return GroupedLengths.of(split.batch(seq))


def _dedup(work: GroupedLengths, rows: Sequence[int]) -> float:
    logical = sum(work.prompt_lens[work.group_of_row[r]] for r in rows)
    computed = sum(work.prompt_lens[g] for g in {work.group_of_row[r] for r in rows})
    return 1.0 - computed / logical if logical else 0.0


def _split_count(work: GroupedLengths, parts: Sequence[Sequence[int]]) -> int:
    """Groups held by more than one part."""
    holders: dict[int, int] = {}
    for p in parts:
        for g in {work.group_of_row[r] for r in p}:
            holders[g] = holders.get(g, 0) + 1
    return sum(1 for n in holders.values() if n > 1)


def _by_group(work: GroupedLengths, rows: Sequence[int]) -> list[int]:
    return sorted(rows, key=lambda r: (work.group_of_row[r], r))


def equal_micro_batches(work: GroupedLengths, rows: Sequence[int], size: int) -> list[list[int]]:
    """`rows` into micro-batches of `size` rows (the last one shorter when they do not divide), whole
    groups where sizes allow, balanced by zorro's cost: each boundary cuts at most one group."""
    rows = list(rows)
    k = -(-len(rows) // size)
    if k <= 1:
        return [_by_group(work, rows)]
    if len(rows) % size == 0:
        p = partition_ranks(work.subset(rows), k, attention_weight=ATTENTION_WEIGHT, bounded_splits=True)
        return [_by_group(work, [rows[i] for i in part]) for part in p.parts]
    ordered = _by_group(work, rows)  # groups contiguous: a cut every `size` rows splits at most one group
    return [ordered[s : s + size] for s in range(0, len(ordered), size)]


def budget_micro_batches(work: GroupedLengths, rows: Sequence[int], max_tokens: int, count: int) -> list[list[int]]:
    """`rows` into exactly `count` micro-batches of whole groups (groups above the budget split), each
    within `max_tokens` computed tokens where it can be, balanced by zorro's cost. With fewer groups
    (or pieces) than `count`, the largest micro-batches are halved until there are `count`."""
    rows = list(rows)
    if count > len(rows):
        raise _Refused(f"{len(rows)} rows cannot fill {count} micro-batches")
    sub = work.subset(rows)
    p = partition_micro_batches(sub, max_tokens, attention_weight=ATTENTION_WEIGHT, min_micro_batches=count)
    parts = [[rows[i] for i in part] for part in p.parts]
    if len(parts) > count:
        raise _Refused(
            f"{count} micro-batches of {max_tokens} tokens cannot hold the groups (zorro needs {len(parts)})"
        )
    while len(parts) < count:
        parts.sort(key=len)
        big = _by_group(work, parts.pop())
        parts += [big[: len(big) // 2], big[len(big) // 2 :]]
    return [_by_group(work, p) for p in parts]


def fixed_micro_batches(work: GroupedLengths, size: int, group_order: Sequence[int]) -> list[list[int]]:
    """Fixed batching's training micro-batches: groups laid whole in `group_order`, cut every `size` rows
    (whole groups when sizes divide, else at most one group per cut); the rows past the last whole
    micro-batch are left out, as the DataLoader's `drop_last=True` leaves them."""
    groups = work.rows_of_group
    rows = [r for g in group_order for r in groups[g]]
    k = len(rows) // size
    return [sorted(rows[s : s + size]) for s in range(0, k * size, size)]


def _dp_size(args: Any) -> int:
    return args.actor.num_nodes * args.actor.num_gpus_per_node // args.ds.ring_attn_size // args.ds.tensor_parallel_size


def _refuse_ring(args: Any) -> None:
    if args.ds.ring_attn_size > 1:
        raise _Refused("ring attention (ds.ring_attn_size > 1) is not served by the dedup path")


REWARD_IN_TRAINER = (
    "a reward model computed in the trainer (OpenRLHF's RewardModelActor, which zorro does not serve) runs "
    "these micro-batches with every row whole: OpenRLHF's own batching sizes them by the tokens it computes"
)
"""Why dynamic log-prob micro-batches are OpenRLHF's when the rollout's rewards come from a reward model."""


def rollout_micro_batches(work: GroupedLengths, args: Any, reward_in_trainer: bool = False) -> list[list[int]]:
    """The log-prob micro-batches of a rollout (row indices), rank 0's first: what
    `split_rollout_samples` returns, as rows (module doc). Raises `_Refused` where it cannot plan, and under
    dynamic batching when `reward_in_trainer` (OpenRLHF's reward model runs the same micro-batches)."""
    _refuse_ring(args)
    if reward_in_trainer and args.train.dynamic_batch_enable:
        raise _Refused(REWARD_IN_TRAINER)
    dp = _dp_size(args)
    b = len(work.group_of_row)
    if b % dp:
        raise _Refused(f"{b} rollout rows do not divide over {dp} ranks")
    local_train = args.train.batch_size // dp if args.train.batch_size % dp == 0 else None
    per_rank = b // dp
    mini = local_train if local_train and per_rank % local_train == 0 else None
    bal = balance_rows(
        work.group_of_row, [work.prompt_lens[g] for g in work.group_of_row], work.response_lens, dp, mini
    )
    if args.train.dynamic_batch_enable:
        max_tokens = args.rollout.max_tokens_per_gpu
        count = max(
            len(partition_micro_batches(work.subset(rows), max_tokens, attention_weight=ATTENTION_WEIGHT).parts)
            for rows in bal.ranks
        )
        per = [budget_micro_batches(work, rows, max_tokens, count) for rows in bal.ranks]
    else:
        per = [equal_micro_batches(work, rows, args.rollout.micro_batch_size) for rows in bal.ranks]
        if len({len(p) for p in per}) != 1:
            raise _Refused("the ranks' rows make different numbers of micro-batches")
    micro = [m for rank in per for m in rank]
    BATCHING.split_groups += _split_count(work, micro)
    BATCHING.micro_batch_dedup += [_dedup(work, m) for m in micro]
    return micro


def split_rollout_samples(
    rollout_samples: list[Experience],
    args: Any,
    pad_token_id: int,
    reward_in_trainer: bool = False,
    plain_reason: Optional[str] = None,
) -> Optional[list[Experience]]:
    """`RemoteExperienceMaker.split_rollout_samples` with whole groups per rank and micro-batch, or None
    (the reason warned) where zorro cannot plan, or `plain_reason` says a model the calls go to falls
    back whole (its micro-batches must fit the tokens OpenRLHF computes): the caller then runs
    OpenRLHF's own method. `reward_in_trainer`: OpenRLHF's reward model will run the same micro-batches
    (`rollout_micro_batches`).

    Sets `index` as OpenRLHF does (the sample's place in the rollout, which its advantage code
    sorts rewards back by); returns concatenated micro-batches in rank order.
    """
    for i, sample in enumerate(rollout_samples):
        sample.index = [i]
    try:
        if plain_reason:
            raise _Refused(plain_reason)
        micro = rollout_micro_batches(grouped_lengths(rollout_samples), args, reward_in_trainer)
    except _Refused as e:
        BATCHING.fallback.fall_back(str(e))
        return None
    BATCHING.fallback.served()
    return [Experience.concat_experiences([rollout_samples[i] for i in m], pad_token_id) for m in micro]


def rank_rows(work: GroupedLengths, args: Any) -> list[list[int]]:
    """Each rank's training rows (module doc: `balance_experiences`). Raises `_Refused` where it cannot plan."""
    _refuse_ring(args)
    dp = _dp_size(args)
    b = len(work.group_of_row)
    if b % dp:
        raise _Refused(f"{b} rows do not divide over {dp} ranks")
    local = args.train.batch_size // dp
    mini = local if local and (b // dp) % local == 0 else None
    bal = balance_rows(
        work.group_of_row, [work.prompt_lens[g] for g in work.group_of_row], work.response_lens, dp, mini
    )
    return bal.ranks


def balance_experiences(experiences: list[Experience], args: Any) -> list[Experience]:
    """OpenRLHF's `balance_experiences` (one Experience per DP rank) with whole groups per rank and step."""
    items: list[Experience] = []
    for exp in experiences:
        items.extend(split_experience_batch(exp))
    try:
        ranks = rank_rows(grouped_lengths(items), args)
    except _Refused as e:
        BATCHING.fallback.fall_back(str(e))
        return openrlhf_balance_experiences(experiences, args)
    BATCHING.fallback.served()
    return [make_experience_batch([items[i] for i in rows]) for rows in ranks]


class GroupedReplayBuffer(NaiveReplayBuffer):
    """OpenRLHF's `NaiveReplayBuffer` whose training micro-batches hold whole prompt groups (module doc).

    Same constructor. In fixed batching the buffer serves micro-batches (lists of rows, as its dynamic
    mode does), so `sample_batch_size`, which `ppo_train` passes to its DataLoader, reads 1 while a
    plan is in use; the rows per micro-batch are the constructor's `sample_batch_size`.
    """

    items: list[Experience]
    dynamic_indices: list[list[int]]
    dynamic_batch: bool
    dynamic_batch_num_tokens: list[float]
    dynamic_global_batch_size: list[float]
    dynamic_sample_loss_scale: list[float]
    dynamic_optimizer_step: list[int]

    def __init__(self, sample_batch_size: int, *args: Any, **kwargs: Any) -> None:
        self._plan: Optional[list[list[int]]] = None
        self._planned = False
        super().__init__(sample_batch_size, *args, **kwargs)
        self.micro_batch_rows = sample_batch_size
        self.zorro_micro_batches: list[list[int]] = []
        """The rows (indices into `items`) of each training micro-batch of the last plan."""
        self.plain_reason: Optional[str] = None
        """Why the trainer's model computes every row whole (set by its `ppo_train`, actor.plain_buffer):
        then OpenRLHF's own batching forms the micro-batches, sized by the tokens it computes."""

    @property
    def sample_batch_size(self) -> int:
        if not self.dynamic_batch and self._grouped_plan() is not None:
            return 1
        return self._sample_batch_size

    @sample_batch_size.setter
    def sample_batch_size(self, value: int) -> None:
        self._sample_batch_size = value

    def sample(self) -> Experience:
        """OpenRLHF's `sample` (rows drawn at random), with the constructor's batch size."""
        saved, self._planned, self._plan = (self._planned, self._plan), True, None
        try:
            return super().sample()
        finally:
            self._planned, self._plan = saved

    def append(self, experience: Experience) -> None:
        self._invalidate()
        super().append(experience)

    def clear(self) -> None:
        self._invalidate()
        super().clear()

    def _invalidate(self) -> None:
        self._plan, self._planned = None, False

    def _grouped_plan(self) -> Optional[list[list[int]]]:
        """Fixed batching: the micro-batches of whole groups (None: OpenRLHF's row shuffle serves)."""
        if self._planned:
            return self._plan
        self._planned = True
        if not self.items:
            return None
        try:
            if self.plain_reason:
                raise _Refused(self.plain_reason)
            work = grouped_lengths(self.items)
        except _Refused as e:
            BATCHING.fallback.fall_back(str(e))
            return None
        size = self.micro_batch_rows
        k = len(self.items) // size  # the DataLoader's drop_last=True: whole micro-batches only
        if k == 0:
            BATCHING.fallback.fall_back(f"{len(self.items)} rows make no micro-batch of {size}")
            return None
        # torch's default generator, as the DataLoader's shuffle draws from
        self._plan = fixed_micro_batches(work, size, torch.randperm(len(work.prompt_lens)).tolist())
        self.zorro_micro_batches = self._plan
        BATCHING.fallback.served()
        BATCHING.split_groups += _split_count(work, self._plan)
        BATCHING.micro_batch_dedup += [_dedup(work, m) for m in self._plan]
        return self._plan

    def __len__(self) -> int:
        if not self.dynamic_batch and self._grouped_plan() is not None:
            return len(self._plan or [])
        return super().__len__()

    def __getitem__(self, idx: int) -> Any:
        if not self.dynamic_batch and self._grouped_plan() is not None:
            return [self.items[i] for i in (self._plan or [])[idx]]
        return super().__getitem__(idx)

    def collate_fn(self, batch: Any) -> Experience:
        if not self.dynamic_batch and self._grouped_plan() is not None:
            return make_experience_batch(batch[0], self.packing_samples)
        return super().collate_fn(batch)

    def setup_dynamic_batch(self, strategy: Any) -> None:
        """OpenRLHF's dynamic batching (its steps and their loss normalisation), then each step's rows
        re-partitioned into micro-batches of whole groups; the count per step is what zorro needs under
        `train.max_tokens_per_gpu` (tokens it computes), the maximum over the DP ranks, as OpenRLHF
        all-reduces its own count (every rank runs as many backward passes)."""
        args = strategy.args
        if self.plain_reason:  # the model computes every row whole: OpenRLHF's batching as it is
            BATCHING.fallback.fall_back(self.plain_reason)
            super().setup_dynamic_batch(strategy)
            return
        work: Optional[GroupedLengths] = None
        try:
            _refuse_ring(args)
            work = grouped_lengths(self.items)
        except _Refused as e:
            BATCHING.fallback.fall_back(str(e))
        if work is not None:
            # Groups contiguous (stable: the order balance_experiences gave is kept), so OpenRLHF's step
            # slices of train.batch_size / dp rows cut at most one group each.
            order = [r for rows in work.rows_of_group for r in rows]
            self.items = [self.items[i] for i in order]
            work = work.subset(order)
        super().setup_dynamic_batch(strategy)
        steps: list[list[int]] = [[]]  # the micro-batch indices of each optimizer step
        for i, last in enumerate(self.dynamic_optimizer_step):
            steps[-1].append(i)
            if last:  # OpenRLHF steps the optimizer after a step's last micro-batch
                steps.append([])
        steps = [s for s in steps if s]
        if not steps:
            return
        rows = [[r for i in step for r in self.dynamic_indices[i]] for step in steps]
        budget = args.train.max_tokens_per_gpu
        need = [
            len(partition_micro_batches(work.subset(r), budget, attention_weight=ATTENTION_WEIGHT).parts)
            if work is not None
            else len(step)
            for r, step in zip(rows, steps)
        ]
        counts = strategy.all_reduce(torch.tensor(need, dtype=torch.int, device=torch.cuda.current_device()), op="max")
        indices: list[list[int]] = []
        scales: list[float] = []
        tokens: list[float] = []
        sizes: list[float] = []
        flags: list[int] = []
        for step, step_rows, count in zip(steps, rows, counts.tolist()):
            new: Optional[list[list[int]]] = None
            if work is not None:
                try:
                    new = budget_micro_batches(work, step_rows, budget, count)
                except _Refused as e:
                    BATCHING.fallback.fall_back(str(e))
                else:
                    BATCHING.fallback.served()
                    BATCHING.split_groups += _split_count(work, new)
                    BATCHING.micro_batch_dedup += [_dedup(work, m) for m in new]
            if new is None:  # OpenRLHF's own partition, into the count the ranks agreed on
                lengths = [int(self.items[r].total_length.item()) for r in step_rows]
                new = [[step_rows[j] for j in p] for p in get_seqlen_balanced_partitions(lengths, count, False)]
            indices += new
            scales += [len(p) / len(step_rows) for p in new]
            tokens += [self.dynamic_batch_num_tokens[step[0]]] * len(new)
            sizes += [self.dynamic_global_batch_size[step[0]]] * len(new)
            flags += [0] * (len(new) - 1) + [1]
        self.dynamic_indices, self.dynamic_sample_loss_scale = indices, scales
        self.dynamic_batch_num_tokens, self.dynamic_global_batch_size = tokens, sizes
        self.dynamic_optimizer_step = flags
        self.zorro_micro_batches = indices
