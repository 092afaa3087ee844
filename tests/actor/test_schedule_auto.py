"""schedule="auto" (zorro_core.actor.auto): the prompt-once schedule where it computes fewer FLOPs and
its counted peak is at most the within-micro-batch path's at the same budget, else that path; the
choice and its reason on the output, and the chosen path's results equal to running it directly."""

import pytest
import torch

from zorro_core import ActorConfig, DeduplicatedActor
from zorro_core.actor.auto import ScheduleChoice, TokenBytes, choose_schedule
from zorro_core.actor.schedule import ScheduleOutput
from zorro_core.models.registry import model_shape
from zorro_core.plan.batch import RolloutBatch
from zorro_core.stack.checkpointing import checkpointed


def long_prompt_batch() -> RolloutBatch:
    """One group: a 12-token prompt, 4 responses of 2 tokens; at a budget of 2 each row (14 tokens)
    is a micro-batch of its own on the within path, computing the prompt 4 times."""
    prompt = [5, 17, 33, 2, 9, 41, 7, 12, 30, 3, 8, 1]
    return RolloutBatch.from_lists([prompt] * 4, [[4, 9], [20, 21], [7, 7], [3, 30]])


def loss_fn(out, rows):
    return out.log_probs.sum()


def run(actor, batch, schedule, flavour):
    actor.model.zero_grad(set_to_none=True)
    with checkpointed(actor.model, flavour):
        out = actor.forward_backward(batch, loss_fn, 2, schedule=schedule)
    grads = [p.grad.clone() for p in actor.model.parameters() if p.grad is not None]
    actor.model.zero_grad(set_to_none=True)
    return out, grads


def test_auto_takes_the_schedule_where_it_wins_both(tiny_models):
    """Checkpointed tiny-qwen3: the kept keys and values (2 layers x 2 heads) cost less per token than
    the one layer a checkpointed micro-batch re-makes, so the schedule's peak is the lower, and it
    computes the prompt once instead of 4 times."""
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    batch = long_prompt_batch()
    out, grads = run(actor, batch, "auto", "non-reentrant")
    choice = out.schedule_choice
    assert isinstance(out, ScheduleOutput) and isinstance(choice, ScheduleChoice)
    assert choice.schedule == "prompt_once" and "fewer FLOPs" in choice.reason
    assert choice.flops_prompt_once < choice.flops_micro_batch and choice.peak_prompt_once <= choice.peak_micro_batch
    assert choice.metrics()["zorro/auto_prompt_once"] == 1.0
    direct, direct_grads = run(actor, batch, "prompt_once", "non-reentrant")
    assert torch.equal(out.log_probs, direct.log_probs)
    assert all(torch.equal(a, b) for a, b in zip(grads, direct_grads))


def test_auto_keeps_the_within_path_where_the_schedule_peak_is_higher(tiny_models):
    """Without checkpointing phase 1's whole graph is held through phase 2: the peak is higher."""
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    batch = long_prompt_batch()
    out, grads = run(actor, batch, "auto", None)
    choice = out.schedule_choice
    assert choice.schedule == "micro_batch" and "counted peak" in choice.reason and "over" in choice.reason
    assert choice.flops_prompt_once < choice.flops_micro_batch
    direct, direct_grads = run(actor, batch, "micro_batch", None)
    assert torch.equal(out.log_probs, direct.log_probs)
    assert all(torch.equal(a, b) for a, b in zip(grads, direct_grads))


def test_auto_keeps_the_within_path_where_no_group_is_split(tiny_models):
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"), config=ActorConfig(schedule="auto"))
    batch = long_prompt_batch()
    actor.model.zero_grad(set_to_none=True)
    out = actor.forward_backward(batch, loss_fn, None)  # the config's schedule: auto
    actor.model.zero_grad(set_to_none=True)
    assert out.schedule_choice.schedule == "micro_batch" and "no fewer FLOPs" in out.schedule_choice.reason


def test_token_bytes_count_the_shape(tiny_models):
    """The per-token count from the shape: a layer's saved tensors and the kept keys and values."""
    model = tiny_models("tiny-qwen3")
    shape = model_shape(model.config)
    tb = TokenBytes.of(shape, torch.float64, True, "compute")
    h, q, kv, mlp = 64, 4 * 16, 2 * (16 + 16), 128
    assert (shape.hidden_size, shape.num_heads * shape.head_dim, shape.intermediate_size) == (h, q, mlp)
    assert tb.layer == 8 * (2 * h + q + kv + 4 * 16 + 3 * mlp)
    assert tb.kept == 8 * kv * 2 and tb.layer_input == 8 * h
    assert tb.logits == shape.vocab_size * (8 + 4)
    assert tb.graph(10) == 10 * (2 * 8 * h + tb.layer) and tb.resident(10) == 10 * 2 * 8 * h


def test_auto_with_a_bad_budget_is_refused(tiny_models):
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        actor.forward_backward(long_prompt_batch(), loss_fn, 0, schedule="auto")


def test_auto_on_the_baseline_actor_keeps_the_within_path(tiny_models):
    from zorro_core import BaselineActor

    actor = BaselineActor(model=tiny_models("tiny-qwen3"))
    choice = choose_schedule(actor, long_prompt_batch(), 2)
    assert choice.schedule == "micro_batch" and "does not serve" in choice.reason
