"""DeduplicatedActor and BaselineActor against the per-sequence float64 reference."""

import pytest
import torch
from helpers import ACTOR_BATCHES, GRAD_RTOL, LP_ATOL, MODES, check, mixed_batch

from zorro_core import BaselineActor, DeduplicatedActor, RolloutBatch, create_dummy_batch
from zorro_core.verify.planted_bugs import BUGS, inject_bug
from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

FAMILIES = ["tiny-qwen3", "tiny-llama", "tiny-qwen2"]
BATCHES = ACTOR_BATCHES


@pytest.fixture(scope="module")
def references(tiny_models, per_sequence_reference):
    def get(family, batch_name, temperature):
        return per_sequence_reference(
            (family, batch_name, temperature), lambda: tiny_models(family), BATCHES[batch_name], temperature, seed=1
        )

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("split,attn", MODES)
@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_dedup_matches_per_sequence(tiny_models, references, family, split, attn, batch_name):
    temperature = 0.7
    batch, w, ref = references(family, batch_name, temperature)
    actor = DeduplicatedActor(model=tiny_models(family), use_split_attention=split, attn_implementation=attn)
    out = check(actor, batch, w, ref, temperature)
    assert out.plan.deduplicated and out.plan.num_groups < batch.batch_size


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_baseline_matches_per_sequence(tiny_models, references, family, padded, attn):
    batch, w, ref = references(family, "mixed", 0.7)
    actor = BaselineActor(model=tiny_models(family), attn_implementation=attn, padded=padded)
    check(actor, batch, w, ref, 0.7)


def test_temperature_one_and_no_entropy(tiny_models):
    model = tiny_models("tiny-qwen3")
    batch = mixed_batch()
    w = token_weights(batch, seed=2)
    ref_lp, _, ref_grads = per_sequence(model, batch, 1.0, w, entropy=False)
    lp, ent, grads, _ = actor_run(DeduplicatedActor(model=model), batch, 1.0, w, entropy=False)
    assert ent is None
    assert (lp - ref_lp).abs().max().item() < LP_ATOL
    assert max_rel_grad_error(grads, ref_grads)[0] < GRAD_RTOL


def test_identical_prompts_under_different_padding_merge(tiny_models):
    """Same real prompt, different garbage under the padding mask, different widths of padding
    across rows of different prompt lengths: rows must merge by content alone."""
    batch = RolloutBatch.from_lists([[4, 5, 6], [9, 9, 9, 9, 9], [4, 5, 6]], [[1, 2], [3], [4, 5, 6]])
    batch.prompts[0, :2] = 77
    batch.prompts[2, :2] = 13
    model = tiny_models("tiny-qwen3")
    w = token_weights(batch, seed=5)
    ref = per_sequence(model, batch, 1.0, w)
    out = check(DeduplicatedActor(model=model), batch, w, ref, 1.0)
    assert out.plan.group_of_row.tolist() == [0, 1, 0]


def test_all_unique_prompts_take_the_causal_path(tiny_models):
    batch = create_dummy_batch(batch_size=4, num_unique_prompts=4, prompt_len=6, response_len=3, vocab_size=256, seed=7)
    model = tiny_models("tiny-llama")
    w = token_weights(batch, seed=6)
    out = check(DeduplicatedActor(model=model), batch, w, per_sequence(model, batch, 1.0, w), 1.0)
    assert out.plan.cross is None


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 0.15)])
def test_low_precision_close_to_baseline(dtype, atol):
    """Smoke check in low precision: dedup and packed baseline agree to the dtype's noise."""
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3"), dtype=dtype, attn_implementation="sdpa")
    batch = create_dummy_batch(
        batch_size=6, num_unique_prompts=2, prompt_len=16, response_len=8, vocab_size=256, vary_lengths=True, seed=8
    )
    d = DeduplicatedActor(model=model).forward(batch).log_probs
    b = BaselineActor(model=model).forward(batch).log_probs
    assert d.dtype == torch.float32
    assert (d - b).abs().max().item() < atol


@pytest.mark.parametrize("what", list(BUGS))
def test_bugs_fail_by_orders_of_magnitude(tiny_models, references, what):
    """A real bug (zorro_core.verify.planted_bugs.BUGS, the plans `zorro verify` corrupts) must fail
    the comparison by far more than the tolerance."""
    batch, w, ref = references("tiny-qwen3", "mixed", 0.7)
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    with inject_bug(what, actor):
        lp, ent, grads, _ = actor_run(actor, batch, 0.7, w)
    lp_err = (lp - ref[0]).abs().max().item()
    g_err, _ = max_rel_grad_error(grads, ref[2])
    assert lp_err > 1e3 * LP_ATOL or g_err > 1e3 * GRAD_RTOL, (lp_err, g_err)
