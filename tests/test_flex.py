"""FlexAttention mask mode: the BlockMask equals the plan's mask; on CUDA, the actor equals the baseline."""

import pytest
import torch

from zorro_core import BaselineActor, DeduplicatedActor, RolloutBatch, build_dedup_plan, create_dummy_batch
from zorro_core.attention.flex import BLOCK, flex_unavailable


def test_flex_on_cpu_is_refused_with_the_reason(tiny_models):
    if flex_unavailable("cpu") is None:
        pytest.skip("flex trains on this device")
    with pytest.raises(ValueError, match="no backward on CPU"):
        DeduplicatedActor(
            model=tiny_models("tiny-qwen3"), use_split_attention=False, attn_implementation="flex_attention"
        )


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
    why = flex_unavailable("cuda" if torch.cuda.is_available() else "cpu")
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
