"""The public API checks its arguments: one error naming the argument and what it takes, never a
torch IndexError, a silent 0 or a silently different result.

- joined_logprobs: input_ids and attention_mask of the same shape, rows_per_call >= 1, a 0/1 mask.
- RolloutBatch is immutable (frozen; a tensor changed in place is validated again at the next forward).
- ActorConfig: types and choices checked at construction (the field and its allowed values named).
- The actor's forward and forward_backward: a RolloutBatch, a bool calculate_entropy, a callable
  loss_fn; a model_name_or_path that is not a model directory says so.
- regroup: a RolloutBatch and a finite attention_weight >= 0, checked before any collective.
- A row longer than the model's max_position_embeddings is computed with a warning naming both."""

import dataclasses
import math
import time
import warnings

import pytest
import torch

from zorro_core import DeduplicatedActor, RolloutBatch, create_dummy_batch
from zorro_core.actor.config import VARLEN_BACKENDS, ActorConfig
from zorro_core.attention.backends import BACKENDS
from zorro_core.distributed.regroup import regroup
from zorro_core.integrations.layout import joined_logprobs


def _batch(**kw) -> RolloutBatch:
    args = dict(batch_size=4, num_unique_prompts=2, prompt_len=8, response_len=4, vocab_size=256, seed=1)
    return create_dummy_batch(**{**args, **kw})


def _joined(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    ids = torch.cat([batch.prompts, batch.responses], 1)
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1)
    return ids, mask, batch.responses.shape[1]


@pytest.fixture(scope="module")
def actor():
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32, attn_implementation="sdpa", seed=0)
    return DeduplicatedActor(model=model)


# joined_logprobs (defect 4)


@pytest.mark.parametrize("rows", [2, 6])
def test_joined_logprobs_refuses_a_mask_with_other_rows(actor, rows):
    ids, mask, r = _joined(_batch())
    other = torch.ones(rows, mask.shape[1], dtype=mask.dtype)
    with pytest.raises(ValueError, match="attention_mask.*input_ids|input_ids.*attention_mask"):
        joined_logprobs(actor, ids, other, r)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_joined_logprobs_refuses_rows_per_call_below_one(actor, n):
    ids, mask, r = _joined(_batch())
    with pytest.raises(ValueError, match="rows_per_call"):
        joined_logprobs(actor, ids, mask, r, rows_per_call=n)


def test_joined_logprobs_refuses_a_mask_that_is_not_0_or_1(actor):
    ids, mask, r = _joined(_batch())
    half = mask.double() * 0.5
    with pytest.raises(ValueError, match="attention_mask must hold only 0 and 1"):
        joined_logprobs(actor, ids, half, r)


def test_joined_logprobs_refuses_bad_types(actor):
    ids, mask, r = _joined(_batch())
    with pytest.raises(ValueError, match="input_ids"):
        joined_logprobs(actor, ids.float(), mask, r)
    with pytest.raises(ValueError, match="response_width"):
        joined_logprobs(actor, ids, mask, 2.5)


# RolloutBatch after construction (defect 5)


def test_a_batchs_fields_cannot_be_reassigned():
    batch = _batch()
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.prompts = batch.prompts.float() + 0.7  # type: ignore[misc]


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: b.responses.__setitem__((0, 0), -3), "negative token id"),
        (lambda b: b.prompt_mask.__setitem__((0, -3), 0), "not left-padded"),
        (lambda b: b.response_mask.__setitem__((1, slice(None)), 0), "all padding"),
        (lambda b: b.prompt_mask.__setitem__((0, 0), 2), "only 0 and 1"),
    ],
    ids=["negative-id", "hole-in-prompt-mask", "empty-response", "mask-2"],
)
def test_a_batch_changed_in_place_is_checked_again_at_forward(actor, change, match):
    batch = _batch()
    actor.forward(batch)
    change(batch)
    with pytest.raises(ValueError, match=match):
        actor.forward(batch)


def test_the_unchanged_check_costs_under_one_percent_of_a_forward(actor):
    batch = _batch(batch_size=16, num_unique_prompts=4, prompt_len=128, response_len=32)
    with torch.no_grad():
        actor.forward(batch)
        n = 5
        t0 = time.perf_counter()
        for _ in range(n):
            actor.forward(batch)
        call = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(1000):
        batch.check_unchanged()
    check = (time.perf_counter() - t0) / 1000
    assert check < 0.01 * call, (check, call)


# ActorConfig (defect 6)


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_split_attention", None),
        ("use_split_attention", "no"),
        ("use_split_attention", 1),
        ("attn_implementation", "evil"),
        ("attn_implementation", 3),
        ("varlen_backend", "evil"),
        ("logits_memory_budget_mib", True),
        ("logits_mode", None),
        ("sharing", None),
        ("router_aux_weighting", 1),
    ],
)
def test_actor_config_refuses_a_bad_value_naming_the_field_and_its_choices(field, value):
    with pytest.raises(ValueError, match=field) as e:
        ActorConfig(**{field: value})
    msg = str(e.value)
    if field == "attn_implementation":
        assert "sdpa" in msg and "eager" in msg
    if field == "varlen_backend":
        assert all(name in msg for name in VARLEN_BACKENDS)
    if field == "use_split_attention":
        assert "True or False" in msg


def test_varlen_backends_are_the_ones_that_exist():
    assert set(VARLEN_BACKENDS) == set(BACKENDS)
    for name in VARLEN_BACKENDS:
        assert ActorConfig(varlen_backend=name).varlen_backend == name


def test_actor_config_keeps_accepting_the_good_values():
    for attn in (None, "auto", "eager", "sdpa", "flash_attention_2", "flex_attention"):
        ActorConfig(attn_implementation=attn)
    ActorConfig(use_split_attention=False, logits_memory_budget_mib=1.5, logits_mode="memory")


# The actor's call (unclear answers)


@pytest.mark.parametrize("bad", [None, {"prompts": 1}, (1, 2)])
def test_forward_takes_only_a_rollout_batch(actor, bad):
    with pytest.raises(TypeError, match="RolloutBatch"):
        actor.forward(bad)


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_calculate_entropy_must_be_a_bool(actor, bad):
    with pytest.raises(TypeError, match="calculate_entropy"):
        actor.forward(_batch(), calculate_entropy=bad)


def test_forward_backward_refuses_a_loss_fn_that_is_not_callable(actor):
    with pytest.raises(TypeError, match="loss_fn"):
        actor.forward_backward(_batch(), None)
    assert all(p.grad is None for p in actor.model.parameters())


def test_a_path_that_is_not_a_model_directory_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a model directory") as e:
        DeduplicatedActor(model_name_or_path=str(tmp_path))
    assert "config.json" in str(e.value)


# regroup and long rows (defect 13)


@pytest.mark.parametrize("w", [math.nan, -1.0, math.inf, "1", True])
def test_regroup_refuses_a_bad_attention_weight_before_any_collective(w):
    with pytest.raises(ValueError, match="attention_weight"):
        regroup(_batch(), attention_weight=w)


@pytest.mark.parametrize("bad", [{"a": 1}, None])
def test_regroup_takes_only_a_rollout_batch(bad):
    with pytest.raises(TypeError, match="RolloutBatch"):
        regroup(bad)


def test_forward_backward_refuses_a_bad_attention_weight(actor):
    with pytest.raises(ValueError, match="attention_weight"):
        actor.forward_backward(_batch(), lambda out, rows: out.log_probs.sum(), attention_weight=math.nan)


def test_a_row_longer_than_the_models_positions_is_warned_about():
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3", max_position_embeddings=16), dtype=torch.float32, seed=0)
    actor = DeduplicatedActor(model=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        actor.forward(_batch(prompt_len=8, response_len=4))  # 12 <= 16: no warning
    with pytest.warns(UserWarning, match=r"20 tokens.*max_position_embeddings.*16"):
        actor.forward(_batch(prompt_len=16, response_len=4))
