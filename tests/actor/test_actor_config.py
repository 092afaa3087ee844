"""ActorConfig: one frozen, documented place for the actors' options, taken by every caller."""

import dataclasses
import inspect

import pytest

from zorro_core import ActorConfig, BaselineActor, DeduplicatedActor
from zorro_core.actor.config import FIELDS


def test_every_field_has_a_line_of_doc():
    source = inspect.getsource(ActorConfig)
    for f in dataclasses.fields(ActorConfig):
        after = source.split(f"    {f.name}:", 1)[1].splitlines()[1].strip()
        assert after.startswith('"""'), f"{f.name} has no docstring line"


def test_frozen_and_replace_refuses_unknown_options():
    cfg = ActorConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sharing = "prefix"  # type: ignore[misc]
    assert cfg.replace(sharing="prefix").sharing == "prefix" and cfg.sharing == "prompt"
    with pytest.raises(TypeError, match="unknown actor option"):
        cfg.replace(use_split=False)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(logits_mode="fast"), "logits_mode"),
        (dict(router_aux_weighting="rows"), "router_aux_weighting"),
        (dict(logits_memory_budget_mib=0), "logits_memory_budget_mib"),
        (dict(logits_memory_budget_mib=float("nan")), "logits_memory_budget_mib"),
        (dict(logits_chunk_size=0), "logits_chunk_size"),
        (dict(max_seq_len=True), "max_seq_len"),
        (dict(sharing="suffix"), "sharing"),
        (dict(min_shared_tokens=0), "min_shared_tokens"),
    ],
)
def test_bad_values_are_refused_with_their_name(bad, match):
    with pytest.raises(ValueError, match=match):
        ActorConfig(**bad)


@pytest.mark.parametrize("cls", [DeduplicatedActor, BaselineActor])
def test_actors_take_a_config_and_keyword_overrides(cls, tiny_models):
    model = tiny_models("tiny-qwen3")
    actor = cls(model=model, config=ActorConfig(logits_mode="memory"), use_split_attention=False)
    assert actor.config.logits_mode == "memory" and not actor.config.use_split_attention
    # The resolved config names what runs: the model's own attention, no varlen backend in mask mode.
    assert actor.config.attn_implementation == actor.attn_implementation and actor.config.varlen_backend is None
    with pytest.raises(TypeError, match="unknown actor option"):
        cls(model=model, split=True)


def test_keyword_options_are_the_config_fields():
    params = set(inspect.signature(ActorConfig).parameters)
    assert params == FIELDS
