"""sharing="prefix" micro-batches cut along the trie (zorro_core.plan.trie_balance).

Gradients: forward_backward over trie micro-batches equals one full-batch pass and the float64
per-sequence reference (log-probs, entropy, every gradient), on a batch whose trie has a system
prompt shared by every group and deeper shared turns, at budgets that keep subtrees whole, split
a shared node, split a prompt group, or put every row alone; split and mask modes, with and
without gradient checkpointing. Balancer: properties over random tries (hypothesis).
"""

import contextlib

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL
from hypothesis import given, settings
from hypothesis import strategies as st
from test_checkpointing import checkpointing

from zorro_core import ActorConfig, BaselineActor, DeduplicatedActor, RolloutBatch, create_dummy_batch
from zorro_core.actor.microbatch import micro_batch_partition
from zorro_core.plan.balance import GroupedLengths, partition_micro_batches, select_rows
from zorro_core.plan.trie import build_trie_plan
from zorro_core.plan.trie_balance import TrieLengths, partition_trie_micro_batches
from zorro_core.verify.reference import loss_of, max_rel_grad_error

SYSTEM = [11, 12, 13, 14, 15, 16]  # every row starts with it
TURNS = {0: [21, 22, 23, 24], 1: [21, 22, 23, 24], 2: [31, 32, 33, 34], 3: [31, 32, 33, 34]}  # groups 0+1, 2+3
USER = {0: [41, 42], 1: [43, 44, 45], 2: [46, 47], 3: [48]}
# (group, response): responses that share their first tokens, identical rows (group 3), length 1.
ROWS = [
    (0, [5, 6, 7]),
    (2, [9]),
    (1, [5, 6, 8, 9]),
    (0, [5, 6, 2, 3, 4]),
    (3, [7, 7]),
    (1, [3]),
    (2, [9, 10, 11]),
    (0, [8, 1]),
    (3, [7, 7]),
    (2, [4, 4]),
]
GROUP = [g for g, _ in ROWS]
UNDER = {t: [i for i, g in enumerate(GROUP) if TURNS[g] == TURNS[t]] for t in (0, 2)}  # rows under each turn
TEMPERATURE = 0.7


def system_batch() -> RolloutBatch:
    """[system] -> [turn] (two groups each) -> [user] (a group) -> responses: a depth-5 trie at
    min_shared_tokens=1; the system prompt is 6 of the whole trie's 42 tokens."""
    return RolloutBatch.from_lists([SYSTEM + TURNS[g] + USER[g] for g, _ in ROWS], [r for _, r in ROWS])


def holders(parts, rows) -> int:
    return sum(1 for p in parts if set(p) & set(rows))


# budget -> what it forces (checked on the partition, so the case is what its name says).
BUDGETS = {
    28: "whole_subtrees",  # each turn's subtree whole in its own micro-batch; only the system prompt twice
    20: "split_shared_node",  # turn 0's subtree (28 tokens) cut between its two groups, turn 2's whole
    18: "split_group",  # group 0 (20 tokens) itself cut
    1: "row_each",  # every row over the budget: one row per micro-batch
}


def check_forced(part, case):
    groups = [[i for i, g in enumerate(GROUP) if g == k] for k in range(4)]
    if case == "whole_subtrees":
        assert holders(part.parts, UNDER[0]) == holders(part.parts, UNDER[2]) == 1 and len(part.parts) == 2
        assert part.recomputed_prompt_tokens == len(SYSTEM)
    elif case == "split_shared_node":
        assert holders(part.parts, UNDER[0]) == 2 and holders(part.parts, UNDER[2]) == 1 and not part.split_groups
        assert part.recomputed_prompt_tokens == 2 * len(SYSTEM) + len(TURNS[0])
    elif case == "split_group":
        assert part.split_groups and all(holders(part.parts, g) <= 2 for g in groups)
    else:
        assert sorted(len(p) for p in part.parts) == [1] * len(ROWS) and part.over_budget == list(range(len(ROWS)))
    assert all(t <= part.budget or i in part.over_budget for i, t in enumerate(part.tokens))


@pytest.fixture(scope="module")
def reference(per_sequence_reference, tiny_models):
    return per_sequence_reference("system", lambda: tiny_models("tiny-qwen3"), system_batch, TEMPERATURE, 5)


def weighted_loss(weights):
    w_lp, w_ent = weights

    def loss_fn(out, rows):  # a sum over rows: micro-batch losses add up to the full batch's
        return loss_of(out.log_probs, out.entropy, (w_lp[rows.cpu()], w_ent[rows.cpu()]))

    return loss_fn


def grads_of(model):
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("ckpt", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("budget", list(BUDGETS))
def test_trie_micro_batches_equal_full_batch_and_reference(tiny_models, reference, budget, split, ckpt):
    batch, w, (ref_lp, ref_ent, ref_grads) = reference
    model = tiny_models("tiny-qwen3")
    actor = DeduplicatedActor(
        model=model, use_split_attention=split, attn_implementation="sdpa", sharing="prefix", min_shared_tokens=1
    )
    loss_fn = weighted_loss(w)
    with checkpointing(model, reentrant=ckpt == "reentrant") if ckpt else contextlib.nullcontext():
        model.zero_grad(set_to_none=True)
        full = actor.forward(batch, temperature=TEMPERATURE, calculate_entropy=True)
        loss_fn(full, torch.arange(batch.batch_size)).backward()
        full_grads = grads_of(model)
        res = actor.forward_backward(
            batch, loss_fn, max_tokens_per_micro_batch=budget, temperature=TEMPERATURE, calculate_entropy=True
        )
        got = grads_of(model)
    check_forced(res.partition, BUDGETS[budget])
    for lp, ent, grads in ((full.log_probs.detach(), full.entropy.detach(), full_grads), (ref_lp, ref_ent, ref_grads)):
        assert (res.log_probs - lp).abs().max().item() < LP_ATOL
        assert (res.entropy - ent).abs().max().item() < LP_ATOL
        err, name = max_rel_grad_error(got, grads)
        assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


def test_prefix_forward_backward_partition_is_the_trie_one(tiny_models):
    """The actor's partition is the trie balancer's, and each micro-batch's tokens are its own plan's."""
    batch = system_batch()
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"), sharing="prefix", min_shared_tokens=1)
    res = actor.forward_backward(batch, lambda out, rows: out.log_probs.sum() * 0, max_tokens_per_micro_batch=28)
    actor.model.zero_grad(set_to_none=True)
    assert res.partition == partition_trie_micro_batches(TrieLengths.of(batch, 1), 28)
    assert res.partition == micro_batch_partition(actor, batch, 28)
    assert res.partition.tokens == [
        build_trie_plan(select_rows(batch, p), None, 1).num_tokens for p in res.partition.parts
    ]
    prompt = partition_micro_batches(GroupedLengths.of(batch), 28)
    assert sum(res.partition.tokens) < sum(TrieLengths.of(batch, 1).tokens(p) for p in prompt.parts)


def test_prompt_mode_and_baseline_partition_by_prompt_group(tiny_models):
    """Only a prefix-sharing dedup actor cuts along the trie: prompt mode and the baseline (which
    shares nothing, whatever its sharing option) partition as before."""
    batch, model = system_batch(), tiny_models("tiny-qwen3")
    prompt = partition_micro_batches(GroupedLengths.of(batch), 20, 0.01)
    assert micro_batch_partition(DeduplicatedActor(model=model), batch, 20, 0.01) == prompt
    baseline = partition_micro_batches(GroupedLengths.of(batch, dedup=False), 20)
    shared = ActorConfig(sharing="prefix")  # a config given to both actors: the baseline reads no sharing
    assert micro_batch_partition(BaselineActor(model=model, config=shared), batch, 20) == baseline


# ---------------------------------------------------------------- the balancer on random tries


@st.composite
def trie_batches(draw):
    """Rows from a few shared chunks (a system prompt, turns) and a 3-token alphabet for the rest,
    so that prompts share runs at several depths and responses share their beginnings."""
    rnd = draw(st.randoms(use_true_random=False))
    chunks = [[rnd.randint(1, 255) for _ in range(rnd.randint(1, 12))] for _ in range(4)]
    system = chunks[0] if draw(st.booleans()) else []
    prompts, responses = [], []
    for _ in range(draw(st.integers(1, 6))):  # groups
        prompt = system + [t for c in rnd.sample(chunks[1:], rnd.randint(0, 3)) for t in c]
        prompt += [rnd.randint(1, 3) for _ in range(rnd.randint(1, 4))]
        for _ in range(rnd.randint(1, 4)):
            prompts.append(prompt)
            responses.append([rnd.randint(1, 3) for _ in range(rnd.randint(1, 8))])
    order = list(range(len(prompts)))
    rnd.shuffle(order)
    return RolloutBatch.from_lists([prompts[i] for i in order], [responses[i] for i in order])


@settings(max_examples=120, deadline=None)
@given(
    batch=trie_batches(),
    budget=st.integers(1, 120),
    min_shared=st.sampled_from([1, 3, 16]),
    attention_weight=st.sampled_from([0.0, 0.01]),
)
def test_trie_partition_properties(batch, budget, min_shared, attention_weight):
    work = TrieLengths.of(batch, min_shared)
    part = partition_trie_micro_batches(work, budget, attention_weight)
    b = batch.batch_size
    # Every row exactly once, parts ascending and non-empty, costs descending.
    assert sorted(r for p in part.parts for r in p) == list(range(b))
    assert all(p and p == sorted(p) for p in part.parts)
    assert part.costs == sorted(part.costs, reverse=True)
    # The counted cost is each micro-batch plan's own: tokens + attention_weight x attended pairs.
    whole = build_trie_plan(batch, None, min_shared)
    for p, tokens, cost in zip(part.parts, part.tokens, part.costs):
        plan = build_trie_plan(select_rows(batch, p), None, min_shared)
        assert tokens == plan.num_tokens
        assert cost == pytest.approx(plan.num_tokens + attention_weight * plan.attended_pairs(), rel=1e-12)
    assert sum(part.tokens) == whole.num_tokens + part.recomputed_prompt_tokens
    # Budget respected where it can be: a micro-batch over it is one row that alone exceeds it.
    for i, (p, tokens) in enumerate(zip(part.parts, part.tokens)):
        assert (tokens > budget) == (i in part.over_budget)
        if tokens > budget:
            assert len(p) == 1 and work.tokens(p) > budget
    # Never more than grouping by prompt, both costed by the micro-batches' own plans.
    by_prompt = partition_micro_batches(GroupedLengths.of(batch), budget, attention_weight)
    assert sum(part.costs) <= sum(work.cost(p, attention_weight) for p in by_prompt.parts) + 1e-9
    # No budget: one micro-batch, the whole batch's plan.
    one = partition_trie_micro_batches(work, None, attention_weight)
    assert one.parts == [list(range(b))] and one.tokens == [whole.num_tokens] and one.recomputed_prompt_tokens == 0


def test_single_row_over_budget_gets_its_own_micro_batch():
    batch = system_batch()
    work = TrieLengths.of(batch, 1)
    budget = 16  # rows 2 and 3 (17 tokens each) cannot fit; every other row can
    too_long = [r for r in range(len(ROWS)) if work.tokens([r]) > budget]
    assert too_long == [2, 3]
    part = partition_trie_micro_batches(work, budget)
    assert sorted(part.parts[i] for i in part.over_budget) == [[2], [3]]
    assert all(t <= budget for i, t in enumerate(part.tokens) if i not in part.over_budget)


def test_system_prompt_once_per_micro_batch_not_per_group():
    """8 groups x 4 responses under a 512-token system prompt, budget = two groups by prompt: the
    trie puts three groups in a micro-batch (512 + 3 x 320 tokens), grouping by prompt two."""
    batch = create_dummy_batch(
        batch_size=32, num_unique_prompts=8, prompt_len=576, response_len=64, vocab_size=256, shared_prefix_len=512
    )
    work = TrieLengths.of(batch)
    budget = 2 * (576 + 4 * 64)
    part = partition_trie_micro_batches(work, budget)
    assert not part.split_groups and sorted(len(p) for p in part.parts) == [8, 12, 12]
    assert sum(part.tokens) == 3 * 512 + 8 * (64 + 4 * 64)
    by_prompt = partition_micro_batches(GroupedLengths.of(batch), budget)
    assert len(by_prompt.parts) == 4 and sum(work.tokens(p) for p in by_prompt.parts) == 4 * 512 + 8 * (64 + 4 * 64)


def test_trie_lengths_are_checked():
    work = TrieLengths.of(system_batch(), 1)
    with pytest.raises(ValueError, match="permutation"):
        TrieLengths(work.order[:-1] + [0], work.lens, work.prompt_lens, work.lcp, work.groups, 1)
    with pytest.raises(ValueError, match="lengths"):
        TrieLengths(work.order, work.lens, work.prompt_lens, work.lcp[:-1], work.groups, 1)
    with pytest.raises(ValueError, match="min_shared_tokens"):
        TrieLengths(work.order, work.lens, work.prompt_lens, work.lcp, work.groups, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        partition_trie_micro_batches(work, 0)
