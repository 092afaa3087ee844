"""A critic (a decoder base and a value head, read through zorro_core.integrations.value_model.ValueModel, as
verl's DedupValueEngine and OpenRLHF's serve_critic read it) under the prompt-once schedule: the schedule
computes log-probs through an lm_head, which a critic does not have, so it is refused with the reason before
any compute (issue 60, defect 1); the critic's values stay served by `response_hidden`."""

import pytest
import torch

from zorro_core import DeduplicatedActor, create_dummy_batch
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.schedule import prompt_once_logprobs, prompt_once_step, schedule_refusal
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.value_model import ValueModel


def tiny_critic():
    """A tiny Qwen3 critic as verl loads it (AutoModelForTokenClassification, one label), random weights."""
    from transformers import AutoModelForTokenClassification

    from zorro_core.models.presets import preset_config

    config = preset_config("tiny-qwen3")
    config.num_labels = 1
    torch.manual_seed(0)
    return AutoModelForTokenClassification.from_config(config, dtype=torch.float64, attn_implementation="eager")


def batch():
    return create_dummy_batch(batch_size=4, num_unique_prompts=2, prompt_len=6, response_len=4, vocab_size=256, seed=3)


class Counting:
    """Counts the critic base's forward calls (any compute at all)."""

    def __init__(self, module):
        self.calls = 0
        module.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))


def test_schedule_refuses_a_critic_before_any_compute():
    critic = tiny_critic()
    actor = DeduplicatedActor(model=ValueModel(critic), config=ActorConfig(schedule="prompt_once"))
    why = schedule_refusal(actor)
    assert why is not None and "value head" in why and "lm_head" in why, why
    count = Counting(critic.model)

    def loss_fn(out, rows):
        return out.log_probs.sum()

    with pytest.raises(UnsupportedModelError, match="value head"):
        prompt_once_step(actor, batch(), loss_fn)
    with pytest.raises(UnsupportedModelError, match="value head"):
        actor.forward_backward(batch(), loss_fn)  # the config's schedule
    with pytest.raises(UnsupportedModelError, match="value head"):
        prompt_once_logprobs(actor, batch())
    assert count.calls == 0
    assert all(p.grad is None for p in critic.parameters())


def test_log_probs_of_a_critic_are_refused_on_every_path():
    """actor.forward / the micro-batch path would read log-probs from the stand-in vocabulary head: refused."""
    critic = tiny_critic()
    actor = DeduplicatedActor(model=ValueModel(critic))
    count = Counting(critic.model)
    with pytest.raises(UnsupportedModelError, match="value head"):
        actor.forward(batch())
    with pytest.raises(UnsupportedModelError, match="value head"):
        actor.forward_backward(batch(), lambda out, rows: out.log_probs.sum())
    assert count.calls == 0
    hidden, plan = actor.response_hidden(batch())  # what a critic is served by
    assert hidden.shape[0] == int(batch().response_mask.sum()) and torch.isfinite(hidden).all()
