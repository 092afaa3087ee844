"""The integrations' shared core (zorro_core.integrations.core): `prompt_groups` against a grouping
written independently (Python tuples of each row's real tokens), the `Fallback` record, the probes."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_core.integrations.core import (
    DedupFallbackWarning,
    Fallback,
    grouped_order,
    prompt_dedup_ratio,
    prompt_groups,
    require_assigned,
    require_attributes,
    require_parameters,
)
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.prompt import group_rows


def independent_groups(prompts: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """Rows numbered by first appearance of the tuple of their real tokens."""
    ids: dict[tuple[int, ...], int] = {}
    return [ids.setdefault(tuple(row[m.bool()].tolist()), len(ids)) for row, m in zip(prompts, mask)]


@st.composite
def batches(draw):
    """Rows drawn from a few distinct prompts (some prefixes of others, some of token 0 or -1 next to
    padding), each row padded on the left, the right or both, the padding columns holding junk."""
    vocab = draw(st.integers(1, 4))
    base = [draw(st.lists(st.integers(-1, vocab), min_size=1, max_size=5)) for _ in range(draw(st.integers(1, 4)))]
    base += [p[: len(p) - 1] for p in base if len(p) > 1][: draw(st.integers(0, 2))]  # strict prefixes
    rows = [base[draw(st.integers(0, len(base) - 1))] for _ in range(draw(st.integers(1, 9)))]
    width = max(map(len, rows)) + draw(st.integers(0, 2))
    prompts = torch.full((len(rows), width), 0, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        start = draw(st.integers(0, width - len(row)))
        prompts[i] = torch.tensor([draw(st.integers(-1, vocab)) for _ in range(width)])  # junk where padded
        prompts[i, start : start + len(row)] = torch.tensor(row)
        mask[i, start : start + len(row)] = 1
    return prompts, mask


@settings(max_examples=300, deadline=None)
@given(batches())
def test_prompt_groups_equals_an_independent_grouping(batch):
    prompts, mask = batch
    assert prompt_groups(prompts, mask).tolist() == independent_groups(prompts, mask)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_grouped_order_and_dedup_ratio_follow_the_groups(batch):
    prompts, mask = batch
    groups = independent_groups(prompts, mask)
    order = grouped_order(prompts, mask).tolist()
    assert sorted(order) == list(range(len(groups)))
    assert [groups[i] for i in order] == sorted(groups)  # groups contiguous, in order of first appearance
    for a, b in zip(order, order[1:]):
        if groups[a] == groups[b]:
            assert a < b  # stable inside a group
    lens = mask.sum(1).tolist()
    first = {g: lens[i] for i, g in reversed(list(enumerate(groups)))}
    assert prompt_dedup_ratio(prompts, mask) == pytest.approx(1 - sum(first.values()) / sum(lens))


def test_prompt_groups_on_random_left_padded_batches_equals_group_rows():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        lengths = torch.randint(1, 4, (5,), generator=g)
        prompts = [torch.randint(0, 3, (int(n),), generator=g).tolist() for n in lengths]
        rows = [prompts[int(i)] for i in torch.randint(0, len(prompts), (8,), generator=g)]
        batch = RolloutBatch.from_lists(rows, [[1]] * len(rows))
        expected = independent_groups(batch.prompts, batch.prompt_mask)
        assert group_rows(batch).tolist() == expected
        assert prompt_groups(batch.prompts, batch.prompt_mask).tolist() == expected


def test_prompt_groups_edges():
    assert prompt_groups(torch.zeros((0, 3), dtype=torch.long)).tolist() == []
    assert prompt_groups(torch.tensor([[1, 2], [1, 2], [2, 1]])).tolist() == [0, 0, 1]  # no mask: every column
    with pytest.raises(ValueError, match="2-D"):
        prompt_groups(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match"):
        prompt_groups(torch.zeros((2, 3), dtype=torch.long), torch.ones((2, 2)))
    assert prompt_dedup_ratio(torch.zeros((0, 2), dtype=torch.long), torch.zeros((0, 2))) == 0.0


def test_fallback_warns_once_per_reason_and_counts():
    fb = Fallback("the trainer's own forward serves this call")
    with pytest.warns(DedupFallbackWarning, match="own forward serves this call: reason a"):
        fb.fall_back("reason a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fb.fall_back("reason a")  # the second time: counted, not warned
        fb.served()
        fb.served()
    with pytest.warns(DedupFallbackWarning, match="reason b"):
        fb.fall_back("reason b")
    with pytest.warns(DedupFallbackWarning, match="^zorro: an untested release$"):
        fb.note("an untested release")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fb.note("an untested release")
    assert fb.counts == {"dedup": 2, "fallback": 3}
    assert fb.reasons == {"reason a": 2, "reason b": 1}
    assert fb.has_fallen_back("reason") and not fb.has_fallen_back("other")
    other = Fallback("x")  # per object: another one warns again
    with pytest.warns(DedupFallbackWarning, match="reason a"):
        other.fall_back("reason a")
    assert fb.counts["fallback"] == 3


class _Trainer:
    known = 1

    def __init__(self):
        self._set_here = 1

    def method(self, model, batch, flag=False):
        return model


def test_probes_name_the_attribute_and_the_versions():
    require_attributes(_Trainer, ("known", "method"), "T 1.0", "T 0.9", "zorro's reader")
    with pytest.raises(
        ImportError, match=r"T 1\.0: .*_Trainer has no gone, which zorro's reader reads \(tested with T 0\.9\)"
    ):
        require_attributes(_Trainer, ("known", "gone"), "T 1.0", "T 0.9", "zorro's reader")
    require_parameters(_Trainer.method, ("self", "model", "batch"), "T 1.0", "T 0.9", "r")
    with pytest.raises(ImportError, match=r"has parameters \('self', 'model', 'batch'\), not"):
        require_parameters(_Trainer.method, ("self", "model", "rows"), "T 1.0", "T 0.9", "r")
    require_assigned(_Trainer, ("__init__",), ("_set_here",), "T 1.0", "T 0.9", "r")
    with pytest.raises(ImportError, match="no longer set _gone"):
        require_assigned(_Trainer, ("__init__",), ("_set_here", "_gone"), "T 1.0", "T 0.9", "r")
    with pytest.raises(ImportError, match="has no method _missing"):
        require_assigned(_Trainer, ("_missing",), ("x",), "T 1.0", "T 0.9", "r")
