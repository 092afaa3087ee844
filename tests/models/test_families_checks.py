"""Fail closed: every configuration the dedup path cannot compute exactly is refused with an error
that names it (UnsupportedModelError, a ValueError)."""

import inspect

import pytest
import torch
from fla_devices import pytorch_delta_rule_on_cpu
from helpers import LP_ATOL, mixed_batch

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.attention.hook import Route, route_mask
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.parts import model_parts
from zorro_core.models.presets import PRESETS, build_model, preset_config
from zorro_core.plan.build import build_dedup_plan
from zorro_core.verify.reference import sequence_forward


def fresh(name="tiny-qwen3", **overrides):
    return build_model(preset_config(name, **overrides), dtype=torch.float64, attn_implementation="eager")


def test_unsupported_model_type():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    )
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2'"):
        DeduplicatedActor(model=model)


def test_unhandled_layer_type():
    model = fresh()
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModelError, match="layer 1 has type 'chunked_attention'"):
        model_parts(model)


@pytest.mark.parametrize(
    "feature,value", [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("attention_chunk_size", 8)]
)
def test_attention_feature_in_config(feature, value):
    model = fresh()
    setattr(model.config, feature, value)
    with pytest.raises(UnsupportedModelError, match=feature):
        DeduplicatedActor(model=model)


@pytest.mark.parametrize("kwarg", ["softcap", "s_aux"])
def test_attention_feature_at_call_time(monkeypatch, kwarg):
    """A layer that passes a feature the hook does not implement (softcapping, attention sinks)."""
    import zorro_core.attention.registration as registration

    model = fresh()
    layer = model.model.layers[0].self_attn
    real = registration.zorro_attention
    monkeypatch.setattr(
        registration,
        "zorro_attention",
        lambda m, *a, **kw: real(m, *a, **({kwarg: torch.ones(1)} if m is layer else {}), **kw),
    )
    with pytest.raises(UnsupportedModelError, match=kwarg):
        DeduplicatedActor(model=model).forward(mixed_batch())


@pytest.mark.parametrize("where", ["attention_dropout", "dropout_module"])
def test_dropout_in_training_mode(where):
    model = fresh(attention_dropout=0.1) if where == "attention_dropout" else fresh()
    if where == "dropout_module":
        model.model.layers[0].mlp.act_fn = torch.nn.Sequential(model.model.layers[0].mlp.act_fn, torch.nn.Dropout(0.2))
    actor = DeduplicatedActor(model=model)
    model.train()
    with pytest.raises(UnsupportedModelError, match="dropout"):
        actor.forward(mixed_batch())
    model.eval()
    actor.forward(mixed_batch())  # inference mode: dropout is off, so it runs


@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-qwen3-next"])
def test_kv_cache(family, monkeypatch):
    """A forward with a filled cache: attention keys outnumber queries / the recurrence has a prior state."""
    from transformers import DynamicCache

    pytorch_delta_rule_on_cpu(monkeypatch)  # the route-less first forward, where fla is installed
    model = fresh(family)
    batch = mixed_batch()
    plan = build_dedup_plan(batch)
    cache = DynamicCache(config=model.config)
    # transformers renamed past_key_values to cache (5.x); the test passes it under the model's name
    name = "cache" if "cache" in inspect.signature(type(model.model).forward).parameters else "past_key_values"
    model.model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True, **{name: cache})
    route = Route(DeduplicatedActor(model=model).route_spec, plan)  # the actor installs the hooks

    with pytest.raises(UnsupportedModelError, match="cache"):
        model.model(
            input_ids=plan.input_ids[None],
            position_ids=plan.position_ids[None] + 3,
            **{name: cache},
            attention_mask=route_mask("cpu"),
            use_cache=True,
            zorro_route=route,
        )


@pytest.mark.parametrize("family,layer_attr", [("tiny-qwen3", "self_attn"), ("tiny-qwen3-next", "linear_attn")])
def test_layer_that_bypasses_the_hooks(family, layer_attr):
    """A token-mixing layer that never reaches the hook or its adapter is caught by the call count."""
    model = fresh(family)
    layer = getattr(model.model.layers[0], layer_attr)
    if layer_attr == "self_attn":
        layer.forward = lambda hidden_states, **kw: (hidden_states.cumsum(1), None)
    else:
        layer.forward = lambda hidden_states, **kw: hidden_states.cumsum(1)
    with pytest.raises(RuntimeError, match="served"):
        DeduplicatedActor(model=model).forward(mixed_batch())


def test_every_preset_is_a_supported_family():
    from zorro_core.models.registry import FAMILIES

    for name in PRESETS:
        cfg = preset_config(name)
        assert cfg.model_type in FAMILIES and name in FAMILIES[cfg.model_type].presets
    assert preset_config("Qwen/Qwen3-30B-A3B").num_experts == 128
    assert preset_config("Qwen/Qwen3-Next-80B-A3B-Instruct").layer_types[:4] == ["linear_attention"] * 3 + [
        "full_attention"
    ]


def test_padded_baseline_still_runs_for_attention_models():
    """The padded baseline (plain HF forward) equals each sequence run alone, log-probs and entropy."""
    model, batch = fresh(), mixed_batch()
    with torch.no_grad():
        ref_lp, ref_ent = sequence_forward(model, batch)
        out = BaselineActor(model=model, padded=True).forward(batch, calculate_entropy=True)
    assert (out.log_probs - ref_lp).abs().max().item() < LP_ATOL
    assert (out.entropy - ref_ent).abs().max().item() < LP_ATOL


def test_family_support_lists_every_supported_type(monkeypatch):
    import zorro_core.models.registry as registry

    support = registry.family_support("cpu")
    assert set(support) == set(registry.FAMILIES)
    assert "PyTorch fallback" in support["qwen3_next"]  # on CPU whether fla is installed or not
    # On CUDA the line follows fla's availability (the device is only named, never used here).
    monkeypatch.setattr(registry, "fla_available", lambda: None)
    assert "flash-linear-attention varlen kernel" in registry.family_support("cuda")["qwen3_next"]
    monkeypatch.setattr(registry, "fla_available", lambda: "not importable")
    assert "fla not installed" in registry.family_support("cuda")["qwen3_next"]


# How the README's family list names each model type `zorro env` lists.
README_NAMES = {
    "qwen3": "Qwen3",
    "llama": "Llama",
    "qwen2": "Qwen2",
    "mistral": "Mistral",
    "gemma3_text": "Gemma 3",
    "olmo3": "OLMo 3",
    "qwen3_moe": "Qwen3-MoE",
    "deepseek_v3": "DeepSeek-V3",
    "glm4_moe": "GLM-4 MoE",
    "qwen3_next": "Qwen3-Next",
    "qwen3_5_text": "Qwen3.5",
    "qwen3_5_moe_text": "Qwen3.5 dense/MoE",
}


def test_the_readme_lists_every_family_zorro_env_lists():
    from pathlib import Path

    from zorro_core.models.registry import family_support

    readme = Path(__file__).resolve().parents[2].joinpath("README.md").read_text()
    families = " ".join(readme[readme.index("- Families:") :].split("\n\n")[0].split())
    assert set(family_support("cpu")) == set(README_NAMES), "a family was added or removed: name it in the README"
    missing = [name for name in README_NAMES.values() if name not in families]
    assert not missing, f"README's family list lacks {missing}"
