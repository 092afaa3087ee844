"""Gemma 3 text and OLMo 3 against the per-sequence float64 reference: log-probs, entropy, every gradient.

Both interleave sliding and full layers by `config.layer_types` and give each layer type its own
rope (Gemma 3: rope_local_base_freq on sliding layers, linear scaling on global ones in the tiny
preset; OLMo 3: YaRN on the full layers). Gemma 3 also scales scores by query_pre_attn_scalar**-0.5
(the layer hands it to the hook as `scaling`; the tiny preset makes it differ from head_dim**-0.5)
and its embeddings by sqrt(hidden_size) inside embed_tokens. OLMo 3's q/k RMSNorms act on each
token's whole projection, so they are token-wise.

transformers' sliding window for both (masking_utils.sliding_window_overlay, through
create_sliding_window_causal_mask): key k is visible to query q iff k > q - window, i.e.
q - k < window, by absolute position, which is the hook's rule. The tiny presets use a window
of 5 and every row here is longer, so the window cuts in the prompt, in the responses and (prefix
sharing) in the shared system prefix; test_wrong_window_fails shows a window off by one is seen.
"""

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, MODES, check
from test_checkpointing import checkpointing

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.presets import build_model, preset_config
from zorro_core.models.registry import FAMILIES, family_support
from zorro_core.verify.reference import max_rel_grad_error, per_sequence, token_weights

MODELS = ["tiny-gemma3", "tiny-olmo3"]
WINDOW = 5
TEMPERATURE = 0.8

BATCHES = {
    # prompts 6..13 tokens, responses 1..9: a lone row per prompt is possible, padding on both sides
    "long_padded": lambda: create_dummy_batch(
        batch_size=5, num_unique_prompts=2, prompt_len=13, response_len=9, vocab_size=256, vary_lengths=True, seed=11
    ),
    "unpadded": lambda: create_dummy_batch(
        batch_size=3, num_unique_prompts=1, prompt_len=11, response_len=7, vocab_size=256, seed=12
    ),
    # a system prefix (7 tokens, longer than the window) shared across groups, then distinct prompts
    "system_padded": lambda: create_dummy_batch(
        batch_size=6,
        num_unique_prompts=3,
        prompt_len=16,
        response_len=6,
        vocab_size=256,
        vary_lengths=True,
        shared_prefix_len=7,
        seed=3,
    ),
    "system_unpadded": lambda: create_dummy_batch(
        batch_size=4, num_unique_prompts=2, prompt_len=11, response_len=5, vocab_size=256, shared_prefix_len=6, seed=4
    ),
}


def dedup(model, sharing="prompt", split=True, attn="sdpa"):
    kw = dict(sharing="prefix", min_shared_tokens=1) if sharing == "prefix" else {}
    return DeduplicatedActor(model=model, use_split_attention=split, attn_implementation=attn, **kw)


@pytest.fixture(scope="module")
def references(tiny_models, per_sequence_reference):
    def get(name, batch_name):
        return per_sequence_reference(
            (name, batch_name), lambda: tiny_models(name), BATCHES[batch_name], TEMPERATURE, seed=7
        )

    return get


@pytest.mark.parametrize("name", MODELS)
def test_tiny_presets_interleave_layer_types_with_a_short_window(name):
    cfg = preset_config(name)
    assert cfg.sliding_window == WINDOW
    assert {"sliding_attention", "full_attention"} == set(cfg.layer_types) and 2 <= len(cfg.layer_types) <= 4
    rope = cfg.rope_parameters
    if "sliding_attention" in rope:  # a rope per layer type (transformers >= 5.2x; older OLMo 3 configs: one rope)
        assert rope["sliding_attention"] != rope["full_attention"]  # one rope for every layer would be seen
    if name == "tiny-gemma3":
        assert cfg.query_pre_attn_scalar != cfg.head_dim  # a hook ignoring `scaling` would be seen
        assert not cfg.use_bidirectional_attention and cfg.attn_logit_softcapping is None
        assert cfg.final_logit_softcapping is None


def test_every_row_is_longer_than_the_window():
    for make in BATCHES.values():
        batch = make()
        lengths = batch.prompt_mask.sum(1) + batch.response_mask.sum(1)
        assert lengths.min().item() > WINDOW


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("split,attn", MODES)
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_dedup_matches_per_sequence(tiny_models, references, name, split, attn, sharing, batch_name):
    batch, w, ref = references(name, batch_name)
    out = check(dedup(tiny_models(name), sharing, split, attn), batch, w, ref, TEMPERATURE)
    assert out.plan.num_tokens < out.plan.logical_tokens  # something was shared
    if sharing == "prefix" and batch_name.startswith("system"):
        assert out.plan.depth >= 2  # the system prefix is a node of its own


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("padded,attn", [(False, "eager"), (False, "sdpa"), (True, "eager"), (True, "sdpa")])
@pytest.mark.parametrize("batch_name", ["long_padded", "system_unpadded"])
def test_baselines_match_per_sequence(tiny_models, references, name, padded, attn, batch_name):
    """Packed and padded baselines; the padded one builds a mask per window, which must carry it."""
    batch, w, ref = references(name, batch_name)
    check(BaselineActor(model=tiny_models(name), padded=padded, attn_implementation=attn), batch, w, ref, TEMPERATURE)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sharing,batch_name", [("prompt", "long_padded"), ("prefix", "system_padded")])
def test_flex_mask_mode_matches_per_sequence(tiny_models, references, name, sharing, batch_name):
    from zorro_core.attention.flex import flex_unavailable

    if flex_unavailable("cpu"):
        pytest.skip(flex_unavailable("cpu"))
    batch, w, ref = references(name, batch_name)
    check(dedup(tiny_models(name), sharing, False, "flex_attention"), batch, w, ref, TEMPERATURE)


@pytest.fixture(scope="module")
def own_models():
    """float64 models for this module only (checkpointing switches them to training mode and back)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = build_model(preset_config(name), dtype=torch.float64, attn_implementation="eager", seed=1)
        return cache[name]

    return get


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_actors_match_per_sequence(own_models, name, reentrant):
    model = own_models(name)
    batch = BATCHES["long_padded"]()
    w = token_weights(batch, seed=2)
    ref = per_sequence(model, batch, TEMPERATURE, w)  # plain forward, eval mode, no checkpointing
    actors = [
        lambda: dedup(model, "prompt", True, "sdpa"),
        lambda: dedup(model, "prompt", False, "eager"),
        lambda: dedup(model, "prefix", True, "eager"),
        lambda: BaselineActor(model=model, attn_implementation="eager", padded=True),
    ]
    with checkpointing(model, reentrant):
        for make in actors:
            check(make(), batch, w, ref, TEMPERATURE)


def weighted_loss(weights):
    """The reference's loss (sum of weighted log-probs and entropies) restricted to a micro-batch's rows."""
    w_lp, w_ent = weights

    def loss_fn(out, rows):
        return (w_lp[rows].to(out.log_probs) * out.log_probs).sum() + (w_ent[rows].to(out.entropy) * out.entropy).sum()

    return loss_fn


# 16 tokens split the 2-prompt groups (prompts up to 13 + responses up to 9); 1 puts every row alone.
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("budget", [16, 1])
@pytest.mark.parametrize("kind", ["dedup", "dedup-prefix", "baseline-padded"])
def test_micro_batches_match_per_sequence(tiny_models, references, name, budget, kind):
    batch_name = "system_padded" if kind == "dedup-prefix" else "long_padded"
    batch, w, (ref_lp, ref_ent, ref_grads) = references(name, batch_name)
    model = tiny_models(name)
    actor = {
        "dedup": lambda: dedup(model),
        "dedup-prefix": lambda: dedup(model, "prefix"),
        "baseline-padded": lambda: BaselineActor(model=model, padded=True, attn_implementation="eager"),
    }[kind]()
    model.zero_grad(set_to_none=True)
    res = actor.forward_backward(
        batch, weighted_loss(w), max_tokens_per_micro_batch=budget, temperature=TEMPERATURE, calculate_entropy=True
    )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert len(res.partition.parts) > 1
    assert (res.log_probs.detach() - ref_lp).abs().max().item() < LP_ATOL
    assert (res.entropy.detach() - ref_ent).abs().max().item() < LP_ATOL
    err, pname = max_rel_grad_error(grads, ref_grads)
    assert err < GRAD_RTOL, f"gradient of {pname} off by {err:.2e}"


@pytest.mark.parametrize("name", MODELS)
def test_wrong_window_fails(tiny_models, references, monkeypatch, name):
    """The comparison sees a window off by one (what `<=` instead of `<` would do) on these families."""
    import zorro_core.attention.registration as registration

    real = registration.zorro_attention

    def widened(*args, sliding_window=None, **kwargs):
        return real(*args, sliding_window=None if sliding_window is None else sliding_window + 1, **kwargs)

    batch, w, ref = references(name, "long_padded")
    monkeypatch.setattr(registration, "zorro_attention", widened)
    with pytest.raises(AssertionError):
        check(dedup(tiny_models(name)), batch, w, ref, TEMPERATURE)


def test_ignored_scaling_fails(tiny_models, references, monkeypatch):
    """Gemma 3's query_pre_attn_scalar reaches the hook as `scaling`; a hook that used head_dim**-0.5 is seen."""
    import zorro_core.attention.registration as registration

    real = registration.zorro_attention
    monkeypatch.setattr(registration, "zorro_attention", lambda *a, scaling=None, **kw: real(*a, scaling=None, **kw))
    batch, w, ref = references("tiny-gemma3", "long_padded")
    with pytest.raises(AssertionError):
        check(dedup(tiny_models("tiny-gemma3")), batch, w, ref, TEMPERATURE)


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ],
)
@pytest.mark.parametrize("actor", [DeduplicatedActor, BaselineActor])
def test_gemma3_features_refused(fields, match, actor):
    model = build_model(preset_config("tiny-gemma3", **fields), dtype=torch.float64, attn_implementation="eager")
    with pytest.raises(UnsupportedModelError, match=match):
        actor(model=model)


@pytest.mark.parametrize("name", MODELS)
def test_non_causal_config_refused(name):
    model = build_model(preset_config(name), dtype=torch.float64)
    model.config.is_causal = False  # transformers then builds bidirectional masks for the model's own forward
    with pytest.raises(UnsupportedModelError, match="is_causal"):
        DeduplicatedActor(model=model)


def test_gemma3_multimodal_refused_pointing_at_the_text_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    text = {k: v for k, v in preset_config("tiny-gemma3").to_dict().items() if k in ("hidden_size", "vocab_size")}
    cfg = AutoConfig.for_model(
        "gemma3",
        text_config=dict(text, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    for actor in (DeduplicatedActor, BaselineActor):
        with pytest.raises(UnsupportedModelError, match="gemma3_text"):
            actor(model=model)


def test_registry_entries():
    support = family_support("cpu")
    for model_type, liger in (
        ("gemma3_text", "apply_liger_kernel_to_gemma3_text"),
        ("olmo3", "apply_liger_kernel_to_olmo3"),
    ):
        assert FAMILIES[model_type].liger_function == liger
        assert support[model_type].startswith("ok")
    assert "gemma3" not in FAMILIES
    assert preset_config("google/gemma-3-27b-pt").query_pre_attn_scalar == 168
    assert preset_config("allenai/Olmo-3-1025-7B").layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"]
