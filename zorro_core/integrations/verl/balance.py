"""Whole prompt groups on each data-parallel rank of a verl job, balanced by what zorro computes.

verl's V1 trainer (`verl/trainer/ppo/v1/trainer_base.py`, `_balance_batch`) orders the rows of a
step so that its dispatch, which splits them into `dp_size` equal contiguous chunks, gives each
rank a similar sum of `calculate_workload(seq_len)`; it does not look at `uid`, so the n
responses of a prompt land on different ranks and each rank recomputes the prompt. Here the
rows are grouped (the `uid` of verl's key `{uid}_{session_id}_{index}`, or prompt content) and
whole groups are given to ranks, each rank the same number of rows, balanced by zorro's cost:
a group's prompt once plus its responses (`zorro_core.integrations.rank_balance`, shared with
OpenRLHF's batching, with verl's attention term). Each rank's rows are then cut by verl's worker into PPO mini-batches of equal row counts
(`TrainingWorker.train_mini_batch`, in order unless `shuffle`): the rows are placed so that
those boundaries fall between groups too. Where sizes force a split (verl's upsampled padding
rows, groups of unequal size), every boundary between two (rank, mini-batch) slots cuts at most
one group; the split groups and their ranks are reported.

Pure host-side Python on the rows' lengths: verl's trainer (`trainer`) calls it on the
step's `KVBatchMeta` tags; nothing here imports verl.
"""

from __future__ import annotations

from typing import Optional, Sequence

from zorro_core.integrations.rank_balance import ATTENTION_WEIGHT, Balance, balance_rows

__all__ = ["ATTENTION_WEIGHT", "Balance", "balance_rows", "balance_tags", "group_of_keys", "split_key"]


def split_key(key: str) -> Optional[tuple[str, int]]:
    """(uid, output index) of a V1 trainer key `{uid}_{session_id}_{index}`, None if not one."""
    parts = key.rsplit("_", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[2])


def group_of_keys(keys: Sequence[str], prompts: Optional[Sequence[Sequence[int]]] = None) -> list[int]:
    """The group of each row, numbered 0.. in order of first appearance.

    The first output (index 0) of every session of a uid shares the uid's prompt; a later output
    of a multi-turn session carries that session's own history, so it is a group of its own. Rows
    whose key is not verl's format are grouped by `prompts` (their token ids) when given, else
    each is its own group.
    """
    ids: dict[object, int] = {}
    out = []
    for i, key in enumerate(keys):
        parsed = split_key(key)
        if parsed is not None and parsed[1] == 0:
            name: object = ("uid", parsed[0])
        elif parsed is None and prompts is not None:
            name = ("prompt", tuple(prompts[i]))
        else:
            name = ("row", i)
        out.append(ids.setdefault(name, len(ids)))
    return out


def balance_tags(
    keys: Sequence[str],
    tags: Sequence[dict],
    dp_size: int,
    mini_batch_rows: Optional[int] = None,
    prompts: Optional[Sequence[Sequence[int]]] = None,
) -> Balance:
    """`balance_rows` on a V1 trainer step: verl's keys, and the `prompt_len` / `response_len` tags
    its agent loop (and `upsample_batch_to_divisible_size`, for padding rows) writes."""
    missing = [i for i, t in enumerate(tags) if "prompt_len" not in t or "response_len" not in t]
    if missing:
        raise ValueError(f"rows {missing[:5]} have no prompt_len/response_len tags (not the V1 agent loop's)")
    return balance_rows(
        group_of_keys(keys, prompts),
        [t["prompt_len"] for t in tags],
        [t["response_len"] for t in tags],
        dp_size,
        mini_batch_rows,
    )
