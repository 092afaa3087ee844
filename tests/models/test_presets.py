"""Presets: seeded random weights without touching the caller's RNG."""

import torch
from transformers import AutoModelForCausalLM

from zorro_core.models.presets import build_model, preset_config


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_build_model_leaves_the_global_rng_as_it_was():
    """The caller's global RNG state is the same after build_model as before, so the caller's next
    draws are those it would have made without the call."""
    torch.manual_seed(1234)
    torch.rand(3)  # some state that is not a fresh seed
    state = torch.get_rng_state()
    expected = torch.rand(5)
    torch.set_rng_state(state)
    build_model(preset_config("tiny-qwen3"), seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(torch.rand(5), expected)


def test_build_model_weights_come_from_the_seed():
    """Same seed, same weights, whatever the global RNG's state; another seed, other weights; and
    the weights are those of torch.manual_seed(seed) before from_config (the seeding they always had)."""
    config = preset_config("tiny-qwen3")
    torch.manual_seed(1)
    a = _weights(build_model(config, seed=3))
    torch.manual_seed(2)
    b = _weights(build_model(config, seed=3))
    c = _weights(build_model(config, seed=4))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)
    torch.manual_seed(3)
    old = _weights(AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa"))
    assert all(torch.equal(a[n], old[n]) for n in a)
