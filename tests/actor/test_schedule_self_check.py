"""The prompt-once schedule's self-check and the model's own errors (#60 item 2): an error the plain
computation also raises is the caller's (it reaches the caller, no verdict is recorded, the next step
checks again); NaN from the model's own weights is not blamed on the schedule; only a schedule that
disagrees with the plain computation, or raises where it does not, runs its micro-batches on their own."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import mixed_batch
from test_self_check import RaisesOnce

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.schedule import prompt_once_step
from zorro_core.actor.self_check import SelfCheckWarning
from zorro_core.models.presets import build_model, preset_config


def _model():
    return build_model(preset_config("tiny-qwen3"), dtype=torch.float64, seed=0)


def _loss(out, rows):
    return out.log_probs.sum()


def _schedule_verdicts(actor):
    return {k: v for k, v in actor.self_check.verdicts.items() if k[0] == "prompt_once"}


def test_the_models_transient_error_reaches_the_caller_and_the_next_step_checks_again():
    model = _model()
    actor = DeduplicatedActor(model=model, self_check=True)
    model.model.layers[0].register_forward_hook(RaisesOnce())
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelfCheckWarning)
        with pytest.raises(RuntimeError, match="the model's own hook broke") as raised:
            prompt_once_step(actor, mixed_batch(), _loss, 8)
        assert "not a fault of zorro's path" in "\n".join(raised.value.__notes__)
        assert not _schedule_verdicts(actor) and actor.self_check.failed is None
        assert all(p.grad is None for p in model.parameters())
        res = prompt_once_step(actor, mixed_batch(), _loss, 8)
    assert res.fallback is None and actor.self_check.metric() == 1.0
    (verdict,) = _schedule_verdicts(actor).values()
    assert verdict.passed


def test_an_error_the_plain_computation_also_raises_is_the_callers():
    model = _model()
    actor = DeduplicatedActor(model=model, self_check=True)
    model.model.layers[0].register_forward_hook(RaisesOnce(times=1000))
    with pytest.raises(RuntimeError, match="the model's own hook broke") as raised:
        prompt_once_step(actor, mixed_batch(), _loss, 8)
    assert "the plain computation raises it too" in "\n".join(raised.value.__notes__)
    assert not actor.self_check.verdicts and actor.self_check.failed is None


def test_a_nan_weight_is_not_blamed_on_the_schedule():
    model = _model()
    actor = DeduplicatedActor(model=model, self_check=True)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    with pytest.warns(SelfCheckWarning) as caught:
        res = prompt_once_step(actor, mixed_batch(), _loss, 8)
    messages = [str(c.message) for c in caught]
    assert messages and all("not judged" in m and "not a fault of zorro's path" in m for m in messages)
    assert res.fallback is None and actor.self_check.failed is None and not _schedule_verdicts(actor)
