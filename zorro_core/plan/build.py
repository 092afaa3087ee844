"""`build_dedup_plan`: the one entry point that picks the plan of a batch by its sharing mode."""

from __future__ import annotations

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.prompt import PromptPlan, build_prompt_plan
from zorro_core.plan.protocol import Plan
from zorro_core.plan.sharing import DEFAULT_MIN_SHARED_TOKENS, check_sharing
from zorro_core.plan.trie import TriePlan, build_trie_plan


def build_dedup_plan(
    batch: RolloutBatch,
    dedup: bool = True,
    vocab_size: int | None = None,
    sharing: str = "prompt",
    min_shared_tokens: int | None = None,
) -> Plan:
    """The plan of a batch: `PromptPlan` for `sharing="prompt"`, `TriePlan` for `"prefix"` (folding
    shared runs shorter than `min_shared_tokens`, default DEFAULT_MIN_SHARED_TOKENS). With
    `dedup=False` every row is its own group: the plain plan (see `build_plain_plan`).

    The batch was validated when it was built; its token ids are checked here against
    `vocab_size` when given, once per plan."""
    min_shared_tokens = DEFAULT_MIN_SHARED_TOKENS if min_shared_tokens is None else min_shared_tokens
    check_sharing(sharing, min_shared_tokens)
    if plan_type(dedup, sharing) is TriePlan:
        plan: PromptPlan | TriePlan = build_trie_plan(batch, vocab_size=vocab_size, min_shared_tokens=min_shared_tokens)
        return plan
    return build_prompt_plan(batch, dedup=dedup, vocab_size=vocab_size)


def plan_type(dedup: bool, sharing: str) -> type[PromptPlan] | type[TriePlan]:
    """The class of the plans `build_dedup_plan` builds for these options (what a caller that has
    no plan yet, such as the micro-batch partition, dispatches on)."""
    return TriePlan if dedup and sharing == "prefix" else PromptPlan


def build_plain_plan(batch: RolloutBatch, vocab_size: int | None = None) -> PromptPlan:
    """The plan the packed baseline runs: every row its own group, nothing shared."""
    return build_prompt_plan(batch, dedup=False, vocab_size=vocab_size)
