"""Attention registered once, through transformers' public API: the model stays itself outside the actor."""

import copy

import pytest
import torch
from fla_devices import pytorch_delta_rule_on_cpu
from helpers import TINY_PRESETS, mixed_batch

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.attention.registration import install_attention, is_installed, original_attention
from zorro_core.models.parts import model_parts
from zorro_core.models.presets import build_model, preset_config

FAMILIES = TINY_PRESETS


def _plain(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits.nan_to_num(7.0)  # eager: padding queries are NaN


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_plain_forward_unchanged_after_an_actor_takes_the_model(family, attn, monkeypatch):
    pytorch_delta_rule_on_cpu(monkeypatch)  # plain forwards of Qwen3-Next, where fla is installed
    model = build_model(preset_config(family), dtype=torch.float64, attn_implementation=attn)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (3, 16), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: the original implementation's own mask must be built
    before = _plain(model, ids, mask)
    actor = DeduplicatedActor(model=model, attn_implementation="eager" if attn == "sdpa" else "sdpa")
    actor.forward(mixed_batch())
    assert is_installed(model) and original_attention(model) == attn
    assert torch.equal(_plain(model, ids, mask), before)
    # and after both actors, the padded baseline included (which runs its own implementation)
    if not model_parts(model).num_linear_layers:  # the padded baseline refuses linear-attention layers
        BaselineActor(model=model, padded=True).forward(mixed_batch())
    assert torch.equal(_plain(model, ids, mask), before)


def test_installed_once_and_survives_a_copy():
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa")
    name = None
    for _ in range(2):
        DeduplicatedActor(model=model)
        name = name or model.config._attn_implementation
        assert model.config._attn_implementation == name  # a second actor adds nothing
    twin = copy.deepcopy(model)
    assert original_attention(twin) == "sdpa"
    assert install_attention(twin) == "sdpa"


def test_generate_unchanged_after_an_actor_takes_the_model():
    """A trainer generates with the model the actor holds (TRL without vLLM): greedy tokens identical."""
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa")
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    before = model.generate(ids, **kw)
    DeduplicatedActor(model=model).forward(mixed_batch())
    assert torch.equal(model.generate(ids, **kw), before)


def test_a_reset_attention_is_taken_again():
    """Something resetting the model's attention (set_attn_implementation) after the actor took it: the next forward re-installs."""
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa")
    actor = DeduplicatedActor(model=model)
    model.set_attn_implementation("eager")
    assert not is_installed(model)
    actor.forward(mixed_batch())
    assert is_installed(model) and original_attention(model) == "eager"


def test_a_model_that_refuses_the_registration_is_refused(monkeypatch):
    """transformers only warns when a model cannot switch its attention: the actor refuses it instead."""
    from zorro_core.errors import UnsupportedModelError

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa")
    monkeypatch.setattr(type(model), "_can_set_attn_implementation", classmethod(lambda cls: False))
    with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
        DeduplicatedActor(model=model)


@pytest.mark.slow  # flex_attention compiles on CPU (~15 s); `python -m pytest -m slow` runs it
@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-mistral"])
def test_padded_baseline_runs_an_implementation_other_than_the_models(family):
    """The padded baseline's attention comes from its own attn_implementation (here flex_attention on an sdpa
    model, its BlockMask built by transformers' mask function, sliding window included), not the model's."""
    from zorro_core import create_dummy_batch

    model = build_model(preset_config(family), dtype=torch.float32, attn_implementation="sdpa")
    batch = create_dummy_batch(
        batch_size=4, num_unique_prompts=2, prompt_len=8, response_len=4, vocab_size=256, vary_lengths=True
    )
    with torch.no_grad():  # flex_attention has no backward on CPU
        eager = BaselineActor(model=model, padded=True, attn_implementation="eager").forward(batch).log_probs
        flex = BaselineActor(model=model, padded=True, attn_implementation="flex_attention").forward(batch).log_probs
    assert (flex - eager).abs().max().item() < 1e-5
    assert original_attention(model) == "sdpa"


def test_a_model_taken_in_another_process_is_recognised(monkeypatch):
    """A model whose config already names zorro's function (pickled from a process where an actor took it):
    its original implementation is read from the name and the function registered here."""
    import zorro_core.attention.registration as registration

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa")
    DeduplicatedActor(model=model)
    name = model.config._attn_implementation
    monkeypatch.delitem(registration._ORIGINALS, name)  # as in a fresh process
    assert original_attention(model) == "sdpa" and is_installed(model)
    for original in ("flash_attention_2", "flex_attention", "eager"):
        other = registration.attention_name(original)
        monkeypatch.delitem(registration._ORIGINALS, other)
        model.config._attn_implementation = other  # simulating the pickled config
        assert original_attention(model) == original
