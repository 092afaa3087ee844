"""Options checked where they are given, with the option named (issue 60, defect 7): nothing accepted that
fails later or never applies, and numpy integers taken where the equal int is."""

import math

import numpy as np
import pytest
import torch
from helpers import mixed_batch

from zorro_core import ActorConfig, BaselineActor, DeduplicatedActor
from zorro_core.actor.logprobs import chunk_size_for_budget
from zorro_core.actor.schedule import prompt_once_step


def loss(out, rows):
    return out.log_probs.sum()


@pytest.mark.parametrize("budget", [1e303, 1.5e308, 1e-300])
def test_any_finite_budget_computes(tiny_models, budget):
    """A huge budget was accepted, then every forward failed with 'cannot convert float NaN to integer'."""
    assert chunk_size_for_budget(256, budget) >= 1
    model = tiny_models("tiny-qwen3")
    out = DeduplicatedActor(model=model, logits_mode="memory", logits_memory_budget_mib=budget).forward(mixed_batch())
    ref = DeduplicatedActor(model=model).forward(mixed_batch())
    assert (out.log_probs - ref.log_probs).abs().max().item() < 1e-12


@pytest.mark.parametrize(
    "options,name",
    [
        (dict(sharing="prefix"), "sharing"),
        (dict(schedule="prompt_once"), "schedule"),
        (dict(self_check=True), "self_check"),
        (dict(min_shared_tokens=3), "min_shared_tokens"),
    ],
)
def test_baseline_refuses_the_dedup_actors_options(tiny_models, options, name):
    """Recorded and ignored before: the baseline computes every row its own way whatever they say."""
    with pytest.raises(ValueError, match=f"BaselineActor.*{name}"):
        BaselineActor(model=tiny_models("tiny-qwen3"), **options)
    # a config shared with the dedup actor (the bench's and verify's arms) is taken: its dedup fields are the dedup's
    BaselineActor(model=tiny_models("tiny-qwen3"), config=ActorConfig(**options))


def test_on_prompts_backward_is_checked_before_any_compute(tiny_models):
    model = tiny_models("tiny-qwen3")
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(TypeError, match="on_prompts_backward"):
            prompt_once_step(DeduplicatedActor(model=model), mixed_batch(), loss, on_prompts_backward=5)
    finally:
        handle.remove()
    assert calls == [] and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("parts", [[[0.0, 1, 2], [3, 4, 5]], [[True, False, 2], [3, 4, 5]], [[0.5, 1, 2], [3, 4, 5]]])
def test_parts_must_hold_int_rows(tiny_models, parts):
    with pytest.raises(ValueError, match="parts"):
        prompt_once_step(DeduplicatedActor(model=tiny_models("tiny-qwen3")), mixed_batch(), loss, parts=parts)


def test_numpy_and_tensor_row_indices_are_taken_in_parts(tiny_models):
    model = tiny_models("tiny-qwen3")
    parts = [[np.int64(0), torch.tensor(1), 2], [3, 4, np.int32(5)]]
    model.zero_grad(set_to_none=True)
    res = prompt_once_step(DeduplicatedActor(model=model), mixed_batch(), loss, parts=parts)
    model.zero_grad(set_to_none=True)
    assert res.parts == [[0, 1, 2], [3, 4, 5]] and all(type(r) is int for p in res.parts for r in p)


@pytest.mark.parametrize("value", ["no", 1, 0.0, "False"])
def test_router_aux_loss_must_be_a_bool_or_none(tiny_models, value):
    """`router_aux_loss="no"` was taken as True."""
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3-moe"))
    with pytest.raises(TypeError, match="router_aux_loss"):
        actor.forward(mixed_batch(), router_aux_loss=value)
    with pytest.raises(TypeError, match="router_aux_loss"):
        prompt_once_step(actor, mixed_batch(), loss, router_aux_loss=value)


@pytest.mark.parametrize("weight", [math.nan, -1.0, "0.5", True])
def test_attention_weight_is_checked_under_the_schedule_too(tiny_models, weight):
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    with pytest.raises(ValueError, match="attention_weight"):
        actor.forward_backward(mixed_batch(), loss, attention_weight=weight, schedule="prompt_once")


def test_numpy_numbers_are_taken_where_the_equal_int_or_float_is(tiny_models):
    config = ActorConfig(
        logits_chunk_size=np.int64(4),
        max_seq_len=np.int32(64),
        min_shared_tokens=np.int64(2),
        logits_memory_budget_mib=np.float32(8.0),
    )
    assert config.logits_chunk_size == 4 and type(config.logits_chunk_size) is int
    assert type(config.max_seq_len) is int and type(config.min_shared_tokens) is int
    assert type(config.logits_memory_budget_mib) is float
    import json

    json.dumps(config.as_dict())  # plain values for results files
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    model = actor.model
    model.zero_grad(set_to_none=True)
    actor.forward_backward(
        mixed_batch(), loss, max_tokens_per_micro_batch=np.int64(20), attention_weight=np.float32(0.5)
    )
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="logits_chunk_size"):
        ActorConfig(logits_chunk_size=np.float64(4.0))
