"""Deliberately wrong plans, for proving that verification can fail.

In the package, not in tests/: `zorro verify --inject-bug` proves on the user's own machine that the
check fails on a broken plan, and tests/actor/test_actor.py plants the same bugs. `inject_bug` corrupts the
plans of one actor only, for the duration of a block.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.prompt import PromptPlan, build_prompt_plan
from zorro_core.plan.trie import TriePlan, build_trie_plan


def _row0_prompt_on(batch: RolloutBatch, r: int) -> RolloutBatch:
    """The batch with row 0's prompt in row `r` (its response kept): the wrong_prompt bug's batch."""
    prompts, mask = batch.prompts.clone(), batch.prompt_mask.clone()
    prompts[r], mask[r] = prompts[0], mask[0]
    return RolloutBatch(prompts, mask, batch.responses, batch.response_mask)


def _wrong_prompt(plan: PromptPlan, batch: RolloutBatch) -> PromptPlan:
    rows = (plan.group_of_row != plan.group_of_row[0]).nonzero().flatten()
    if not rows.numel():
        raise ValueError("wrong_prompt needs a batch with two distinct prompts")
    return build_prompt_plan(_row0_prompt_on(batch, int(rows[0])), dedup=plan.deduplicated)


def _positions_restart(plan: PromptPlan, batch: RolloutBatch) -> PromptPlan:
    is_resp = plan.token_segment >= plan.num_groups
    plan.position_ids = torch.where(is_resp, plan.position_ids - plan.prompt_lens[plan.token_group], plan.position_ids)
    return plan


def _first_label_dropped(plan: PromptPlan, batch: RolloutBatch) -> PromptPlan:
    first = plan.response_flat_index % plan.response_width == 0
    plan.logit_index = torch.where(first, plan.logit_index + 1, plan.logit_index)
    return plan


def _first_label_shared(plan: PromptPlan, batch: RolloutBatch) -> PromptPlan:
    first = plan.response_flat_index % plan.response_width == 0
    row = plan.response_flat_index // plan.response_width
    rep = plan.group_rep_row[plan.group_of_row[row]]
    plan.labels = torch.where(first, batch.responses.long()[rep, 0], plan.labels)
    return plan


BUGS: dict[str, tuple[str, Callable[[PromptPlan, RolloutBatch], PromptPlan]]] = {
    "wrong_prompt": ("a response is grouped with (attends to) another row's prompt", _wrong_prompt),
    "positions_restart": ("response positions restart at 0 instead of continuing after the prompt", _positions_restart),
    "first_label_dropped": (
        "each response's first token is read one position late (first label dropped)",
        _first_label_dropped,
    ),
    "first_label_shared": (
        "every response of a group gets the first response's first-token label (rolled row)",
        _first_label_shared,
    ),
}


def _tree_positions_restart(plan, batch: RolloutBatch):
    plan.position_ids = plan.position_ids - plan.node_depth[plan.token_node]
    return plan


def _tree_wrong_prompt(plan, batch: RolloutBatch):
    """A row's response hangs in the trie under row 0's prompt."""
    batch = batch.to(plan.device)
    p, m = batch.prompts, batch.prompt_mask.bool()
    differs = ((p != p[0]) & (m | m[0])).any(1) | (m != m[0]).any(1)
    rows = differs.nonzero().flatten()
    if not rows.numel():
        raise ValueError("wrong_prompt needs a batch with two distinct prompts")
    return build_trie_plan(_row0_prompt_on(batch, int(rows[0])), min_shared_tokens=plan.min_shared_tokens)


# The bugs above for a trie plan (sharing="prefix"), by the same names.
TREE_BUGS = {"positions_restart": _tree_positions_restart, "wrong_prompt": _tree_wrong_prompt}


@contextlib.contextmanager
def inject_bug(name: Optional[str], actor) -> Iterator[dict]:
    """Corrupt every plan `actor` builds, for proving that verification can fail.

    Only that actor: its `plan` is shadowed by an instance attribute for the block's duration
    (the class, and every other actor of the process, are untouched), and what it had is put
    back on exit. Yields a counter; raises RuntimeError at exit if the bug was never applied (so
    a refactor of the actor cannot silently turn the check into a no-op). name None: nothing is
    changed.
    """
    counter = {"applied": 0}
    if name is None:
        yield counter
        return
    if name not in BUGS:
        raise ValueError(f"unknown bug {name!r}; choose one of {sorted(BUGS)}")
    corrupt = BUGS[name][1]
    own = actor.__dict__.get("plan")
    original = actor.plan

    def plan(batch):
        counter["applied"] += 1
        built = original(batch)
        if isinstance(built, TriePlan):  # sharing="prefix": the trie's version of the bug
            if name not in TREE_BUGS:
                raise ValueError(f"bug {name!r} has no sharing='prefix' version; choose one of {sorted(TREE_BUGS)}")
            return TREE_BUGS[name](built, batch)
        return corrupt(built, batch.to(actor.device))

    actor.plan = plan
    try:
        yield counter
    finally:
        if own is None:
            del actor.plan
        else:
            actor.plan = own
    if counter["applied"] == 0:
        raise RuntimeError(
            f"bug {name!r} was never injected: {type(actor).__name__} no longer builds plans through .plan()"
        )
