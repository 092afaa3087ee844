"""Public names renamed in the third pass keep working for one release: the old name warns, naming the new
one and the removal date, and gives the very same object (isinstance checks and filters keep holding)."""

import importlib

import pytest

import zorro_core
from zorro_core.plan.prompt import PromptPlan

RENAMED = [("zorro_core", "DedupPlan", "PromptPlan"), ("zorro_core.plan.prompt", "DedupPlan", "PromptPlan")]


@pytest.mark.parametrize("module,old,new", RENAMED)
def test_an_old_name_warns_and_is_the_new_object(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{old} is now .*{new} \(removed after 2027-06-01\)"):
        value = getattr(mod, old)
    assert value is getattr(mod, new)


def test_the_baseline_plan_is_a_prompt_plan():
    batch = zorro_core.create_dummy_batch(
        batch_size=4, num_unique_prompts=2, prompt_len=5, response_len=3, vocab_size=50
    )
    plain, dedup = zorro_core.build_plain_plan(batch), zorro_core.build_dedup_plan(batch)
    assert isinstance(plain, PromptPlan) and isinstance(dedup, PromptPlan)
    assert not plain.deduplicated and dedup.deduplicated
    assert "PromptPlan" in zorro_core.__all__ and "DedupPlan" not in zorro_core.__all__


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError):
        zorro_core.NoSuchName  # noqa: B018
