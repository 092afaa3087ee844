"""actor.forward_backward and actor.model under misuse: a clear ValueError naming the cause before
any gradient is touched, gradients as they were when a micro-batch fails, no silent stale model."""

import math

import pytest
import torch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.actor.schedule import prompt_once_step


def _batch():
    return create_dummy_batch(
        batch_size=6, num_unique_prompts=3, prompt_len=6, response_len=3, vocab_size=256, vary_lengths=True, seed=2
    )


def _loss(out, rows):
    return -(out.log_probs * 1.0).sum()


@pytest.fixture
def actor(tiny_models):
    model = tiny_models("tiny-qwen3")
    model.zero_grad(set_to_none=True)
    yield DeduplicatedActor(model=model)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("budget", [math.nan, "10", True, 2.5, 0, -3, math.inf])
def test_a_budget_that_is_not_a_positive_int_is_refused(actor, budget):
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch must be an int >= 1"):
        actor.forward_backward(_batch(), _loss, max_tokens_per_micro_batch=budget)
    assert all(p.grad is None for p in actor.model.parameters())


def test_a_numpy_int_budget_is_taken(actor):
    import numpy as np

    out = actor.forward_backward(_batch(), _loss, max_tokens_per_micro_batch=np.int64(20))
    assert len(out.partition.parts) > 1


def test_under_no_grad_is_refused_clearly(actor):
    with torch.no_grad(), pytest.raises(ValueError, match="needs gradients.*no_grad"):
        actor.forward_backward(_batch(), _loss)
    with torch.inference_mode(), pytest.raises(ValueError, match="needs gradients"):
        actor.forward_backward(_batch(), _loss)


def test_a_detached_loss_is_refused_clearly(actor):
    with pytest.raises(ValueError, match="does not require grad"):
        actor.forward_backward(_batch(), lambda out, rows: _loss(out, rows).detach())
    assert all(p.grad is None for p in actor.model.parameters())


def test_a_failing_micro_batch_leaves_no_gradient_when_there_was_none(actor):
    calls = []

    def loss_fn(out, rows):
        calls.append(rows)
        if len(calls) == 2:
            raise RuntimeError("boom in micro-batch 2")
        return _loss(out, rows)

    with pytest.raises(RuntimeError, match="boom in micro-batch 2"):
        actor.forward_backward(_batch(), loss_fn, max_tokens_per_micro_batch=20)
    assert len(calls) == 2
    assert all(p.grad is None for p in actor.model.parameters())


def test_a_failing_micro_batch_over_earlier_gradients_says_what_they_hold(actor):
    """Gradients that existed before the call cannot be restored without a copy as large as them (not
    taken): the error says which micro-batches they now include (docs/failure-modes.md)."""
    actor.forward_backward(_batch(), _loss)
    calls = []

    def loss_fn(out, rows):
        calls.append(rows)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return _loss(out, rows)

    with pytest.raises(RuntimeError, match="boom") as info:
        actor.forward_backward(_batch(), loss_fn, max_tokens_per_micro_batch=20)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "micro-batch 2 of" in notes and "hold micro-batch 1" in notes and "zero_grad" in notes


@pytest.mark.parametrize("cls", [DeduplicatedActor, BaselineActor])
def test_reassigning_the_model_is_refused(tiny_models, cls):
    a = cls(model=tiny_models("tiny-qwen3"))
    with pytest.raises(AttributeError, match="build a new actor"):
        a.model = tiny_models("tiny-llama")
    assert a.model is tiny_models("tiny-qwen3")


def test_a_failing_micro_batch_of_the_schedule_says_what_earlier_gradients_hold(actor):
    """Issue 60, defect 8: the prompt-once step failing in micro-batch 3 left the existing gradients holding
    micro-batches 1-2's response share in silence; the error says so, as forward_backward's does."""
    actor.forward_backward(_batch(), _loss)
    calls = []

    def loss_fn(out, rows):
        calls.append(rows)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return _loss(out, rows)

    parts = [[0, 1], [2, 3], [4], [5]]
    with pytest.raises(RuntimeError, match="boom") as info:
        prompt_once_step(actor, _batch(), loss_fn, parts=parts)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "micro-batch 3 of 4" in notes and "1..2" in notes and "zero_grad" in notes, notes


def test_a_failing_schedule_step_without_earlier_gradients_leaves_none(actor):
    def loss_fn(out, rows):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        prompt_once_step(actor, _batch(), loss_fn)
    assert all(p.grad is None for p in actor.model.parameters())
    assert not getattr(info.value, "__notes__", [])
