"""Dynamic micro-batches for zorro's verl engine, counted in the tokens zorro computes.

With `use_dynamic_bsz=True` verl's `prepare_micro_batches` (`verl/workers/engine/utils.py`) calls
`rearrange_micro_batches`: micro-batches of at most `max_token_len_per_gpu * sp_size` tokens,
each row counted with its whole length. zorro computes a shared prompt once, so a group of 8 x
(8K prompt + 1K response) costs 16K computed tokens, not 72K. `zorro_micro_batches` chooses the
micro-batches with `zorro_core.plan.balance.partition_micro_batches` under the same budget in
computed tokens: groups (rows with identical prompt tokens) whole where they fit, split on
purpose only when a group alone is over the budget, balanced by zorro's cost. verl's
constraints are kept: when verl asks for the same number of micro-batches on every
data-parallel rank (`same_micro_num_in_dp`, always in its FSDP engine) the ranks agree on the
largest count, which is rounded up to `num_batches_divided_by`, and at least
`min_num_micro_batch` run. The indices returned are what verl's `postprocess_batch_func` uses to
put outputs back in the batch's order.

Rows zorro would not serve (`unserved_reason`, rows verl's layout does not split into prompt and
response) are micro-batched by verl's own function on every rank (the ranks agree first), so
verl's forward never sees a micro-batch above verl's own budget.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_name

from zorro_core.integrations.core import prompt_groups
from zorro_core.integrations.rank_balance import ATTENTION_WEIGHT
from zorro_core.plan.balance import GroupedLengths, Partition, partition_micro_batches

__all__ = ["MAX_ROUNDS", "micro_batch_work", "serves_whole_batch", "swap_prepare_micro_batches", "zorro_micro_batches"]

MAX_ROUNDS = 4
"""Rounds of agreeing on one micro-batch count across ranks before verl's own micro-batching is used."""


def micro_batch_work(data) -> Optional[GroupedLengths]:
    """The rank's rows as zorro computes them: groups of identical prompt tokens, each row's
    response; a row with an empty response alone in its group (it is computed whole, if at all).
    None when the rows have no prompt/response split verl's way."""
    from zorro_core.integrations.verl.rows import rows_of

    rows = rows_of(data)
    if isinstance(rows, str):
        return None
    plen_t, offsets = rows.prompt_lens, rows.offsets
    values = data["input_ids"].values()
    column = torch.arange(int(plen_t.max()), device=plen_t.device)[None]
    in_prompt = column < plen_t[:, None]
    tokens = torch.where(in_prompt, values[(offsets[:-1][:, None] + column).clamp(max=values.numel() - 1)], 0)
    same_prompt: list[Any] = prompt_groups(tokens, in_prompt).tolist()
    if rows.images is not None:
        # Rows with images share a prompt only as the vision actor groups them (text, images, positions).
        from zorro_core.plan.multimodal import distinct_images, whole_prompt_groups

        _, image_ids = distinct_images(rows.images.images)
        whole = whole_prompt_groups(rows.images.batch, image_ids, True, rows.images.positions).tolist()
        for k, i in enumerate(rows.live.tolist()):
            same_prompt[i] = ("whole", whole[k])
    plen, rlen = plen_t.tolist(), rows.response_lens.tolist()
    ids: dict[Any, int] = {}
    group = []
    for i, (g, r) in enumerate(zip(same_prompt, rlen)):
        key: Any = ("prompt", g) if r > 0 else ("row", i)
        group.append(ids.setdefault(key, len(ids)))
    prompt_of = [0] * len(ids)
    for i, g in enumerate(group):
        prompt_of[g] = plen[i] if rlen[i] > 0 else plen[i] + rlen[i] - 1
    # A row whose response is empty costs its own length (prompt_of + the 1 below).
    return GroupedLengths(group, [max(1, p) for p in prompt_of], [max(1, r) for r in rlen])


def serves_whole_batch(engine, data) -> bool:
    """Whether zorro's forward would serve every micro-batch of `data` (what its forward step checks,
    on the whole batch, and the actor built): else a micro-batch of zorro's size could reach verl's
    forward above verl's budget."""
    from zorro_core.errors import UnsupportedModelError
    from zorro_core.integrations.verl.rows import temperature_of, unserved_reason

    if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        return False
    if not data["input_ids"].is_nested or unserved_reason(engine, data) is not None:
        return False
    if "temperature" in data.keys() and isinstance(temperature_of(data), str):
        return False
    from zorro_core.integrations.verl.rows import REFUSED

    if engine._zorro_fallback.has_fallen_back(REFUSED):
        return False
    from zorro_core.integrations.verl.rows import sequence_parallel_of

    try:
        actor = engine._zorro_actor()
        sp = sequence_parallel_of(engine)
        if sp is not None and sp.size > 1:
            # Refused under Ulysses (mask mode, linear attention, ...): verl's forward will serve it.
            actor.check_sequence_parallel(sp)
    except UnsupportedModelError:
        return False
    return True


def _exactly(work: GroupedLengths, part: Partition, k: int) -> list[list[int]]:
    """The parts, split until there are k (the one with the most computed tokens halved first)."""
    parts = [list(p) for p in part.parts]
    while len(parts) < k:
        splittable = [i for i, p in enumerate(parts) if len(p) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: work.tokens(parts[i]))
        rows = sorted(parts.pop(i), key=lambda r: (work.group_of_row[r], r))
        half = len(rows) // 2
        parts += [rows[:half], rows[half:]]
    return parts


def _agree(values: list[int], dp_group, sync: bool) -> list[int]:
    if not sync:
        return values
    t = torch.tensor(values, dtype=torch.long, device=get_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)
    return [int(x) for x in t.cpu().tolist()]


def zorro_micro_batches(
    engine,
    data,
    dp_group=None,
    num_batches_divided_by: Optional[int] = None,
    same_micro_num_in_dp: bool = True,
    min_num_micro_batch: Optional[int] = None,
    use_dynamic_bsz_balance: bool = True,
    serves: Optional[Callable[[Any, Any], bool]] = None,
) -> Optional[tuple[list, list[list[int]]]]:
    """(micro-batches, their row indices) under the budget in computed tokens, or None where verl's
    own micro-batching must run (decided alike on every rank when the counts are synchronised).
    `serves(engine, data)`: whether the engine's forward serves every row (default: the FSDP
    engine's `serves_whole_batch`)."""
    sync = dist.is_initialized() and same_micro_num_in_dp and dp_group is not None
    sp_size = tu.get_non_tensor_data(data=data, key="sp_size", default=1)
    budget = int(data["max_token_len_per_gpu"]) * int(sp_size)
    work = micro_batch_work(data) if (serves or serves_whole_batch)(engine, data) else None
    n = len(data)
    floor = max(1, min_num_micro_batch or 1)
    part = partition_micro_batches(work, budget, ATTENTION_WEIGHT, floor) if work is not None else None
    k = len(part.parts) if part is not None else 0
    for _ in range(MAX_ROUNDS):
        # MAX of (count, unserved, -rows): every rank learns whether any rank cannot be served.
        k_all, unserved, neg_rows = _agree([k, int(part is None), -n], dp_group, sync)
        if unserved:
            return None
        if num_batches_divided_by:
            k_all = math.ceil(k_all / num_batches_divided_by) * num_batches_divided_by
        if k_all > -neg_rows:
            return None  # a rank has fewer rows than micro-batches: verl's own path (it refuses alike)
        assert work is not None and part is not None
        if len(part.parts) != k_all:
            part = partition_micro_batches(work, budget, ATTENTION_WEIGHT, k_all)
        parts = _exactly(work, part, k_all)
        done = _agree([-len(parts), len(parts)], dp_group, sync)
        if -done[0] == done[1] == k_all:
            indices = [sorted(p) for p in parts]
            return [tu.index_select_tensor_dict(data, idx) for idx in indices], indices
        k = max(len(parts), k_all)
    return None


@contextmanager
def swap_prepare_micro_batches(
    engine, module: Any = None, serves: Optional[Callable[[Any, Any], bool]] = None
) -> Iterator[None]:
    """verl's FSDP `forward_backward_batch` with zorro's dynamic micro-batches: its module's
    `prepare_micro_batches` answers with `zorro_micro_batches` (verl's own where that declines)
    for the length of the call, and only to this engine's call (the context it runs in).

    The name is the module's, so another engine of the process (verl's critic,
    `FSDPEngineWithValueHead`, which zorro does not serve, or a reference engine) that micro-batches
    while this call runs, in another thread or asyncio task, gets verl's own function: its
    micro-batches are sized by the tokens it computes (every row whole), never by zorro's count."""
    if module is None:
        from verl.workers.engine.fsdp import transformer_impl
    else:
        transformer_impl = module
    original = transformer_impl.prepare_micro_batches
    token = _SERVING.set(engine)

    def prepare(data, dp_group=None, **kwargs):
        if _SERVING.get() is not engine:
            return original(data, dp_group=dp_group, **kwargs)
        if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            chosen = zorro_micro_batches(engine, data, dp_group=dp_group, serves=serves, **kwargs)
            if chosen is not None:
                engine._zorro_micro_batching = "zorro"
                engine._zorro_parts = chosen[1]  # the engine warns once of a group split across them
                return chosen
        engine._zorro_micro_batching = "verl"
        return original(data, dp_group=dp_group, **kwargs)

    transformer_impl.prepare_micro_batches = prepare
    try:
        yield
    finally:
        transformer_impl.prepare_micro_batches = original
        _SERVING.reset(token)


_SERVING: ContextVar[Any] = ContextVar("zorro_verl_micro_batching_engine", default=None)
"""The zorro engine whose forward_backward_batch runs in this context (thread / asyncio task)."""
