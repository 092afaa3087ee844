"""RolloutBatch validation and construction."""

import pytest
import torch

from zorro_core import DeduplicatedActor, RolloutBatch, create_dummy_batch


def good():
    return RolloutBatch.from_lists([[1, 2, 3], [4, 5]], [[6, 7], [8]])


def test_from_lists_pads_prompts_left_and_responses_right():
    b = good()
    assert b.prompts.tolist() == [[1, 2, 3], [0, 4, 5]]
    assert b.prompt_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert b.responses.tolist() == [[6, 7], [8, 0]]
    assert b.response_mask.tolist() == [[1, 1], [1, 0]]
    assert b.to_lists() == ([[1, 2, 3], [4, 5]], [[6, 7], [8]])


@pytest.mark.parametrize(
    "mutate,message",
    [
        (
            lambda t: t.update(
                prompts=t["prompts"][:0],
                prompt_mask=t["prompt_mask"][:0],
                responses=t["responses"][:0],
                response_mask=t["response_mask"][:0],
            ),
            "empty batch",
        ),
        (lambda t: t["response_mask"].__setitem__((1, slice(None)), 0), "response of row 1 is all padding"),
        (lambda t: t["prompt_mask"].__setitem__((0, slice(None)), 0), "prompt of row 0 is all padding"),
        (lambda t: t.update(prompt_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])), "not left-padded"),
        (lambda t: t.update(response_mask=torch.tensor([[1, 1], [0, 1]])), "not right-padded"),
        (lambda t: t.update(prompt_mask=t["prompt_mask"][:, 1:]), "prompt_mask shape"),
        (lambda t: t.update(response_mask=t["response_mask"][:1]), "response_mask shape"),
        (lambda t: t.update(responses=t["responses"][:1], response_mask=t["response_mask"][:1]), "rows"),
        (lambda t: t.update(prompts=t["prompts"].float()), "integer token ids"),
        (lambda t: t.update(prompt_mask=t["prompt_mask"] * 2), "only 0 and 1"),
        (lambda t: t.update(prompts=t["prompts"][0]), "2-D"),
        (lambda t: t["prompts"].__setitem__((0, 0), -3), "negative token id"),
    ],
)
def test_bad_batches_are_refused_with_the_problem_named(mutate, message):
    b = good()
    fields = dict(
        prompts=b.prompts.clone(),
        prompt_mask=b.prompt_mask.clone(),
        responses=b.responses.clone(),
        response_mask=b.response_mask.clone(),
    )
    mutate(fields)
    with pytest.raises(ValueError, match=message):
        RolloutBatch(**fields)


def test_token_ids_beyond_vocab_are_refused(tiny_models):
    b = RolloutBatch.from_lists([[1, 2, 300]], [[4]])
    with pytest.raises(ValueError, match="300 >= the model's vocab size 256"):
        DeduplicatedActor(model=tiny_models("tiny-qwen3")).forward(b)


def test_from_lists_refuses_empty_rows():
    with pytest.raises(ValueError, match="response of row 1 is empty"):
        RolloutBatch.from_lists([[1], [2]], [[3], []])
    with pytest.raises(ValueError, match="empty batch"):
        RolloutBatch.from_lists([], [])


@pytest.mark.parametrize("vary", [False, True])
def test_dummy_batch_shape_groups_and_seed(vary):
    b = create_dummy_batch(
        batch_size=8, num_unique_prompts=3, prompt_len=20, response_len=7, vocab_size=100, seed=5, vary_lengths=vary
    )
    assert b.prompts.shape[0] == 8 and b.responses.shape[0] == 8
    prompts, responses = b.to_lists()
    assert len({tuple(p) for p in prompts}) == 3
    assert all(1 <= len(r) <= 7 for r in responses)
    if not vary:
        assert all(len(p) == 20 for p in prompts) and all(len(r) == 7 for r in responses)
    again = create_dummy_batch(
        batch_size=8, num_unique_prompts=3, prompt_len=20, response_len=7, vocab_size=100, seed=5, vary_lengths=vary
    )
    assert torch.equal(b.prompts, again.prompts) and torch.equal(b.responses, again.responses)


def test_dummy_batch_refuses_impossible_shapes():
    with pytest.raises(ValueError, match="num_unique_prompts"):
        create_dummy_batch(batch_size=2, num_unique_prompts=3, prompt_len=4, response_len=2)


def test_a_forward_checks_the_batch_once(tiny_models, monkeypatch):
    """Structure is checked when the batch is built; a forward checks only the token ids, once."""
    batch = create_dummy_batch(batch_size=4, num_unique_prompts=2, prompt_len=6, response_len=3, vocab_size=256, seed=1)
    calls = {"validate": 0, "check_vocab": 0}
    for name in calls:
        original = getattr(RolloutBatch, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(RolloutBatch, name, counted)
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    actor.forward(batch)
    assert calls == {"validate": 0, "check_vocab": 1}
    bad = RolloutBatch(batch.prompts.clone(), batch.prompt_mask, batch.responses, batch.response_mask)
    bad.prompts[0, -1] = 256
    with pytest.raises(ValueError, match="vocab size 256"):
        actor.forward(bad)
