"""The partitioner: properties over random workloads (hypothesis), KK against the greedy baseline."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_core import RolloutBatch, create_dummy_batch
from zorro_core.plan.balance import (
    GroupedLengths,
    greedy_partition,
    karmarkar_karp,
    partition_micro_batches,
    partition_ranks,
    select_rows,
)


@st.composite
def workloads(draw, max_groups=10, max_size=8, max_prompt=300, max_response=120):
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    gor = [g for g, n in enumerate(sizes) for _ in range(n)]
    draw(st.randoms(use_true_random=False)).shuffle(gor)
    # Renumber by first appearance, as group_rows does.
    first = {g: i for i, g in enumerate(dict.fromkeys(gor))}
    gor = [first[g] for g in gor]
    plens = draw(st.lists(st.integers(1, max_prompt), min_size=len(sizes), max_size=len(sizes)))
    rlens = draw(st.lists(st.integers(1, max_response), min_size=len(gor), max_size=len(gor)))
    return GroupedLengths(gor, plens, rlens)


def assert_each_row_once(work, part):
    rows = sorted(r for p in part.parts for r in p)
    assert rows == list(range(len(work.group_of_row)))
    assert all(p == sorted(p) and p for p in part.parts)


@settings(max_examples=150, deadline=None)
@given(
    work=workloads(),
    budget=st.integers(1, 700),
    attention_weight=st.sampled_from([0.0, 0.01]),
    balance=st.sampled_from(["kk", "greedy"]),
)
def test_micro_batches_properties(work, budget, attention_weight, balance):
    part = partition_micro_batches(work, budget, attention_weight, balance=balance)
    assert_each_row_once(work, part)
    groups = work.rows_of_group
    # Groups whole unless split on purpose: only a group that alone exceeds the budget is split.
    for g in part.split_groups:
        assert work.tokens(groups[g]) > budget
    # Budget respected whenever it can be: a part over it is one row that alone exceeds it.
    for i, p in enumerate(part.parts):
        assert (part.tokens[i] > budget) == (i in part.over_budget)
        if part.tokens[i] > budget:
            assert len(p) == 1 and work.tokens(p) > budget
    # Reported costs add up: every prompt once, plus once more per extra part holding a split group.
    unique = sum(work.prompt_lens) + sum(work.response_lens)
    assert sum(part.tokens) == unique + part.recomputed_prompt_tokens
    assert part.costs == sorted(part.costs, reverse=True)
    assert part.imbalance >= 1.0


@settings(max_examples=50, deadline=None)
@given(work=workloads())
def test_no_budget_is_one_micro_batch(work):
    part = partition_micro_batches(work)
    assert len(part.parts) == 1 and not part.split_groups and part.recomputed_prompt_tokens == 0


@settings(max_examples=100, deadline=None)
@given(work=workloads(), world=st.integers(1, 8), balance=st.sampled_from(["kk", "greedy"]))
def test_ranks_equal_counts(work, world, balance):
    b = len(work.group_of_row)
    if b % world:
        with pytest.raises(ValueError, match="ranks"):
            partition_ranks(work, world, balance=balance)
        return
    part = partition_ranks(work, world, balance=balance)
    assert_each_row_once(work, part)
    assert [len(p) for p in part.parts] == [b // world] * world


@settings(max_examples=50, deadline=None)
@given(groups=st.integers(1, 6), size=st.integers(1, 6), world=st.integers(1, 6), seed=st.integers(0, 99))
def test_ranks_keep_equal_groups_whole(groups, size, world, seed):
    rng = random.Random(seed)
    gor = [g for g in range(groups) for _ in range(size)]
    work = GroupedLengths(gor, [rng.randint(1, 500) for _ in range(groups)], [rng.randint(1, 100) for _ in gor])
    if (groups * size) % world:
        return
    part = partition_ranks(work, world)
    if groups % world == 0:
        assert not part.split_groups and part.recomputed_prompt_tokens == 0


@settings(max_examples=100, deadline=None)
@given(costs=st.lists(st.integers(0, 1000), min_size=0, max_size=40), k=st.integers(1, 7))
def test_karmarkar_karp_places_each_item_once(costs, k):
    parts = karmarkar_karp(costs, k)
    assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(costs)))
    if len(costs) % k == 0:
        parts = karmarkar_karp(costs, k, equal_size=True)
        assert sorted(i for p in parts for i in p) == list(range(len(costs)))
        assert {len(p) for p in parts} == {len(costs) // k}


def test_karmarkar_karp_known_case():
    # 8-7=1; 6-5=1; 4-1=3; 3-1=2: parts 16 and 14 (greedy LPT gets 17 and 13).
    sums = sorted(sum([4, 5, 6, 7, 8][i] for i in p) for p in karmarkar_karp([4, 5, 6, 7, 8], 2))
    assert sums == [14, 16]
    assert sorted(sum([4, 5, 6, 7, 8][i] for i in p) for p in greedy_partition([4, 5, 6, 7, 8], 2)) == [13, 17]


def random_workload(rng: random.Random) -> GroupedLengths:
    """GRPO-like: a few prompts of 64..2048 tokens, 2..16 responses each of 16..1024 tokens."""
    g = rng.randint(2, 16)
    size = rng.choice([2, 4, 8, 16])
    gor = [i for i in range(g) for _ in range(size)]
    return GroupedLengths(gor, [rng.randint(64, 2048) for _ in range(g)], [rng.randint(16, 1024) for _ in gor])


def imbalance_figures(n: int = 100, seed: int = 0):
    """Mean max/mean cost over n random workloads: {(task, balancer): mean imbalance}."""
    rng = random.Random(seed)
    out = {}
    for _ in range(n):
        work = random_workload(rng)
        budget = int(max(work.tokens(r) for r in work.rows_of_group) * rng.uniform(1.0, 3.0))
        for balance in ("kk", "greedy"):
            mb = partition_micro_batches(work, budget, balance=balance)
            out.setdefault(("micro", balance), []).append(mb.imbalance)
            world = next(w for w in (8, 4, 2, 1) if len(work.prompt_lens) % w == 0)  # groups stay whole
            out.setdefault(("ranks", balance), []).append(partition_ranks(work, world, balance=balance).imbalance)
    return {k: sum(v) / len(v) for k, v in out.items()}


def test_kk_beats_greedy_on_random_workloads():
    """On average over random workloads (benchmarks/balance_imbalance.py prints the figures)."""
    figs = imbalance_figures(n=60)
    assert figs[("micro", "kk")] <= figs[("micro", "greedy")]
    assert figs[("ranks", "kk")] <= figs[("ranks", "greedy")]


def test_split_cost_reported():
    """One group of prompt 100 + 4 responses of 60 = 340 tokens under a budget of 230:
    two pieces of 100 + 120, the prompt computed twice; the small group fits with neither."""
    work = GroupedLengths([0, 0, 0, 0, 1], [100, 10], [60, 60, 60, 60, 5])
    part = partition_micro_batches(work, 230)
    assert part.split_groups == [0] and part.recomputed_prompt_tokens == 100
    assert part.tokens == [220, 220, 15] and not part.over_budget


def test_unfittable_row_reported():
    work = GroupedLengths([0, 0, 1], [500, 10], [50, 20, 30])
    part = partition_micro_batches(work, 300)
    assert len(part.over_budget) == 2  # prompt 500 alone exceeds 300: each of its rows stands alone
    assert all(len(part.parts[i]) == 1 for i in part.over_budget)


def test_workload_of_batch_groups_by_content():
    batch = RolloutBatch.from_lists([[4, 5, 6], [9, 9], [4, 5, 6]], [[1, 2], [3], [4, 5, 6]])
    work = GroupedLengths.of(batch)
    assert work.group_of_row == [0, 1, 0] and work.prompt_lens == [3, 2] and work.response_lens == [2, 1, 3]
    assert work.tokens([0, 1, 2]) == 3 + 2 + 6
    assert GroupedLengths.of(batch, dedup=False).tokens([0, 1, 2]) == 3 + 2 + 3 + 6


def test_select_rows_trims_prompt_padding():
    batch = create_dummy_batch(
        batch_size=6, num_unique_prompts=3, prompt_len=10, response_len=4, vocab_size=64, vary_lengths=True, seed=2
    )
    rows = torch.tensor([4, 1])
    sub = select_rows(batch, rows)
    assert sub.responses.shape == (2, batch.responses.shape[1])
    assert sub.prompts.shape[1] == int(batch.prompt_mask[rows].sum(1).max())
    ps, rs = sub.to_lists()
    full_ps, full_rs = batch.to_lists()
    assert ps == [full_ps[4], full_ps[1]] and rs == [full_rs[4], full_rs[1]]


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda: GroupedLengths([], [], []), "empty"),
        (lambda: GroupedLengths([0, 2], [1, 1], [1, 1]), "group id"),
        (lambda: GroupedLengths([0], [0], [1]), "lengths"),
        (lambda: partition_micro_batches(GroupedLengths([0], [1], [1]), 0), "max_tokens"),
        (lambda: partition_micro_batches(GroupedLengths([0], [1], [1]), 5, balance="lpt"), "balance"),
        (lambda: karmarkar_karp([1, 2, 3], 2, equal_size=True), "impossible"),
        (lambda: select_rows(create_dummy_batch(2, 1, 4, 2, 16), [5]), "out of range"),
    ],
)
def test_bad_input_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_large_batch_is_fast():
    """2,048 rows under a tight budget: bounded KK tries, no quadratic search over k."""
    import time

    rng = random.Random(5)
    gor = [g for g in range(256) for _ in range(8)]
    work = GroupedLengths(gor, [rng.randint(64, 2048) for _ in range(256)], [rng.randint(16, 1024) for _ in gor])
    t0 = time.perf_counter()
    part = partition_micro_batches(work, 4096)
    assert time.perf_counter() - t0 < 20
    assert not part.over_budget and max(part.tokens) <= 4096


def test_attention_cost_counts_query_key_pairs():
    # prompt 3 (6 causal pairs) + responses 2 and 1 (2*3 + 3 and 1*3 + 1 pairs): 19 pairs, 6 tokens
    work = GroupedLengths([0, 0], [3], [2, 1])
    assert work.cost([0, 1], attention_weight=0.5) == 6 + 0.5 * 19
    assert work.cost([0, 1]) == 6.0
