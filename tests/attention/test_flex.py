"""FlexAttention mask mode: the BlockMask equals the plan's mask; on CUDA, the actor equals the baseline
(on CPU, through the real kernel against the reference: test_flex_cpu.py)."""

import pytest
import torch

from zorro_core import BaselineActor, DeduplicatedActor, RolloutBatch, build_dedup_plan, create_dummy_batch
from zorro_core.attention.flex import BLOCK, flex_unavailable


def test_flex_on_cpu_without_the_lift_is_refused_with_the_reason(tiny_models, monkeypatch):
    """CPU flex mask mode needs flex_attention's device check to lift; a torch without it is refused."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.delattr(fa, "_validate_device")
    with pytest.raises(ValueError, match="refuses backward on CPU"):
        DeduplicatedActor(
            model=tiny_models("tiny-qwen3"), use_split_attention=False, attn_implementation="flex_attention"
        )


def test_flex_on_cpu_behind_a_failing_probe_is_refused_with_the_reason(monkeypatch):
    """The lifted CPU path serves only after its numeric probe (float64 softmax attention) passes:
    a kernel that is off by 1e-4 in its output is refused, and the actor says why."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from zorro_core.attention import flex

    real = flex._eager_cpu
    monkeypatch.setattr(flex, "_eager_cpu", lambda *a, **kw: real(*a, **kw) * (1 + 1e-4))
    flex.cpu_flex_probe.cache_clear()
    try:
        why = flex_unavailable("cpu")
    finally:
        monkeypatch.undo()
        flex.cpu_flex_probe.cache_clear()
    assert "does not agree with float64 attention (output differs" in why
    assert flex_unavailable("cpu") is None


def test_flex_on_another_device_is_refused_with_the_reason():
    pytest.importorskip("torch.nn.attention.flex_attention")
    assert flex_unavailable("cpu") is None
    assert "runs on CUDA or CPU, not meta" in flex_unavailable("meta")


def test_block_mask_matches_plan_mask(monkeypatch):
    """The mask_mod evaluated densely equals plan.attention_mask() (and padding rows see themselves)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import create_mask

    from zorro_core.attention import flex

    batch = RolloutBatch.from_lists([[1, 2, 3, 4], [5, 6], [1, 2, 3, 4]], [[7, 8], [9], [10, 11, 12]])
    plan = build_dedup_plan(batch)
    captured = {}
    import torch.nn.attention.flex_attention as fa

    def fake(mask_mod, b, h, q_len, kv_len, device):
        captured["dense"] = create_mask(mask_mod, b, h, q_len, kv_len, device=device)[0, 0]
        return "block-mask"

    monkeypatch.setattr(fa, "create_block_mask", fake)
    assert flex.block_mask(plan) == "block-mask"
    dense = captured["dense"]
    t = plan.num_tokens
    assert dense.shape == (BLOCK, BLOCK)
    assert torch.equal(dense[:t, :t], plan.attention_mask())
    assert not dense[:t, t:].any() and not dense[t:, :t].any()
    assert dense[t:, t:].diagonal().all()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_flex_matches_baseline_on_cuda(dtype, atol):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = flex_unavailable("cuda")
    if why:
        pytest.skip(why)
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3"), dtype=dtype, device="cuda", attn_implementation="sdpa")
    batch = create_dummy_batch(
        batch_size=6,
        num_unique_prompts=2,
        prompt_len=40,
        response_len=9,
        vocab_size=256,
        vary_lengths=True,
        device="cuda",
    )
    d = (
        DeduplicatedActor(model=model, use_split_attention=False, attn_implementation="flex_attention")
        .forward(batch)
        .log_probs
    )
    b = BaselineActor(model=model, attn_implementation="sdpa").forward(batch).log_probs
    assert (d - b).abs().max().item() < atol


@pytest.mark.parametrize("family,sharing", [("tiny-qwen3", "prompt"), ("tiny-qwen2-sliding", "prefix")])
def test_flex_gradients_match_per_sequence_on_cuda(tiny_models, family, sharing):
    """CUDA, the compiled kernel (dynamic=True, block tables, Inductor's backward) in float32 with
    gradients, prompt and tree masks, a window (tiny-qwen2-sliding), against the float64 CPU
    reference at float32 tolerances (float32 noise ~1e-6 on log-probs; a wrong mask is >1e-2)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = flex_unavailable("cuda")
    if why:
        pytest.skip(why)
    import copy

    from helpers import mixed_batch

    from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

    model64 = tiny_models(family)
    batch = mixed_batch()
    w = token_weights(batch, seed=1)
    ref_lp, ref_ent, ref_grads = per_sequence(model64, batch, 0.7, w)
    model = copy.deepcopy(model64).to("cuda", torch.float32)
    kw = dict(sharing="prefix", min_shared_tokens=1) if sharing == "prefix" else {}
    actor = DeduplicatedActor(model=model, use_split_attention=False, attn_implementation="flex_attention", **kw)
    lp, ent, grads, _ = actor_run(actor, batch.to("cuda"), 0.7, w)
    assert (lp.double() - ref_lp).abs().max().item() < 1e-4
    assert (ent.double() - ref_ent).abs().max().item() < 1e-4
    g_err, name = max_rel_grad_error(grads, ref_grads)
    assert g_err < 1e-3, f"gradient of {name} off by {g_err:.2e} relative"
