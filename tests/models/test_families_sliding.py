"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window) against the per-sequence reference.

transformers' window: query q sees key k iff q - window < k <= q (masking_utils.sliding_window_overlay),
by absolute position. The tiny presets use a window of 5, shorter than most prompts and responses
here, so both split calls (prompt->prompt and response->(prompt+response)) cut it.
"""

import pytest
import torch
from helpers import MODES, check, mixed_batch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.models.presets import preset_config
from zorro_core.verify.reference import per_sequence, token_weights

FAMILIES = ["tiny-mistral", "tiny-qwen2-sliding", "tiny-qwen3-sliding"]
OVERRIDES = {"tiny-qwen3-sliding": ("tiny-qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1))}


def model_of(tiny_models, family):
    name, overrides = OVERRIDES.get(family, (family, {}))
    return tiny_models(name, **overrides)


BATCHES = {
    "mixed": mixed_batch,
    "long_padded": lambda: create_dummy_batch(
        batch_size=5, num_unique_prompts=2, prompt_len=13, response_len=9, vocab_size=256, vary_lengths=True, seed=11
    ),
    "unpadded": lambda: create_dummy_batch(
        batch_size=3, num_unique_prompts=1, prompt_len=11, response_len=7, vocab_size=256, seed=12
    ),
}


def test_tiny_presets_have_a_window_shorter_than_the_prompts():
    assert preset_config("tiny-mistral").sliding_window == 5
    cfg = preset_config("tiny-qwen2-sliding")
    assert cfg.sliding_window == 5 and cfg.layer_types == ["full_attention", "sliding_attention"]
    cfg = preset_config("tiny-qwen3", **OVERRIDES["tiny-qwen3-sliding"][1])
    assert cfg.sliding_window == 5 and cfg.layer_types == ["full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def references(tiny_models, per_sequence_reference):
    def get(family, batch_name):
        return per_sequence_reference(
            (family, batch_name), lambda: model_of(tiny_models, family), BATCHES[batch_name], 0.9, seed=3
        )

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split,attn", MODES)
@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_sliding_window_dedup_matches_per_sequence(tiny_models, references, family, split, attn, batch_name):
    batch, w, ref = references(family, batch_name)
    actor = DeduplicatedActor(model=model_of(tiny_models, family), use_split_attention=split, attn_implementation=attn)
    out = check(actor, batch, w, ref, 0.9)
    assert out.plan.num_groups < batch.batch_size


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded,attn", [(False, "eager"), (True, "eager"), (True, "sdpa")])
def test_sliding_window_baselines(tiny_models, references, family, padded, attn):
    """Packed and padded baselines; the padded one builds its own 4D mask, which must carry the window."""
    batch, w, ref = references(family, "mixed")
    check(
        BaselineActor(model=model_of(tiny_models, family), padded=padded, attn_implementation=attn), batch, w, ref, 0.9
    )


@pytest.mark.parametrize("window", [1, 4, 6, 7, 8])
def test_window_edges_and_off_by_one(window):
    """Windows of 1, around the prompt length (7) and past the whole sequence: a window off by one
    would differ from the reference at the first key that falls out."""
    from zorro_core.models.presets import build_model

    model = build_model(
        preset_config("tiny-mistral", sliding_window=window), dtype=torch.float64, attn_implementation="eager"
    )
    batch = mixed_batch()
    w = token_weights(batch, seed=4)
    ref = per_sequence(model, batch, 1.0, w)
    for split in (True, False):
        check(
            DeduplicatedActor(model=model, use_split_attention=split, attn_implementation="eager"), batch, w, ref, 1.0
        )


def test_wrong_window_fails(tiny_models, references, monkeypatch):
    """The comparison sees a window off by one (what a `<=` instead of `<` would do)."""
    import zorro_core.attention.registration as registration

    real = registration.zorro_attention

    def widened(*args, sliding_window=None, **kwargs):
        return real(*args, sliding_window=None if sliding_window is None else sliding_window + 1, **kwargs)

    batch, w, ref = references("tiny-mistral", "mixed")
    monkeypatch.setattr(registration, "zorro_attention", widened)  # what the registered dispatch calls with a route
    with pytest.raises(AssertionError):
        check(DeduplicatedActor(model=tiny_models("tiny-mistral")), batch, w, ref, 0.9)
