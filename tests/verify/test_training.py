"""zorro_core.verify.training: GRPO pieces, and K AdamW steps of dedup against baseline against ref64."""

import pytest
import torch

from zorro_core import ActorConfig, RolloutBatch
from zorro_core.verify.training import TRAIN_FLOOR, TrainConfig, group_advantages, grpo_loss, verify_training

SDPA = ActorConfig(attn_implementation="sdpa")


def test_advantages_are_normalised_per_prompt_content():
    batch = RolloutBatch.from_lists([[4, 5], [7, 7, 7], [4, 5], [4, 5], [8, 8]], [[1], [2], [3], [4], [5]])
    batch.prompts[0, 0] = 99  # garbage under the padding mask must not split the group
    rewards = torch.tensor([1.0, 5.0, 2.0, 6.0, -3.0], dtype=torch.float64)
    adv = group_advantages(batch, rewards)
    g = adv[[0, 2, 3]]
    assert abs(g.mean().item()) < 1e-12 and abs(g.std().item() - 1) < 1e-5
    assert adv[1] == 0 and adv[4] == 0  # alone in their group: nothing to compare with


def test_loss_clips_the_ratio():
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.tensor([2.0], dtype=torch.float64)
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    loss, frac = grpo_loss(lp, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-2.0) and frac == 0.0
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.0, 0.0]], dtype=torch.float64))
    # Ratio e^0.5 > 1.2 with a positive advantage: clipped, so no gradient through that token.
    lp2 = torch.tensor([[0.5, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    loss, frac = grpo_loss(lp2, old, adv, mask, clip_eps=0.2)
    loss.backward()
    assert frac == 0.5 and lp2.grad[0, 0] == 0 and lp2.grad[0, 1] != 0
    ent = torch.ones(1, 3, dtype=torch.float64)
    assert grpo_loss(lp.detach(), old, adv, mask, entropy=ent, entropy_coef=0.1)[0].item() == pytest.approx(-2.1)


@pytest.mark.parametrize("dtype,split", [("float64", True), ("float32", False), ("bfloat16", True)])
def test_training_matches_reference_every_step(dtype, split):
    res = verify_training(
        TrainConfig(dtype=dtype, actor=ActorConfig(use_split_attention=split, attn_implementation="sdpa"), steps=3)
    )
    assert res.status == "pass", res.reason
    assert [s.step for s in res.steps] == [1, 2, 3] and all(s.passed for s in res.steps)
    assert max(s.clip_fraction for s in res.steps) > 0  # clipping engaged, so it is exercised
    # bf16 keeps float32 master weights: the run trains (drift << 1) instead of rounding updates away.
    assert max(s.drift_baseline for s in res.steps) < 0.3
    if dtype == "float64":
        assert max(s.drift_dedup for s in res.steps) < TRAIN_FLOOR


def test_linear_attention_trains_at_the_float64_floor():
    """Qwen3-Next: transformers' delta rule rounds to float32 in any dtype; with the dtype-preserving
    kernel installed for all three runs the float64 check is sharp over the README's 5 steps, and the
    module's own kernel is back afterwards."""
    import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next

    kernel = qwen3_next.torch_chunk_gated_delta_rule
    res = verify_training(TrainConfig(model="tiny-qwen3-next", dtype="float64", actor=SDPA, steps=5))
    assert res.status == "pass", res.reason
    assert max(s.drift_dedup for s in res.steps) < 1e-5
    assert qwen3_next.torch_chunk_gated_delta_rule is kernel
    bad = verify_training(
        TrainConfig(model="tiny-qwen3-next", dtype="float64", actor=SDPA, steps=1), bug="wrong_prompt"
    )
    assert bad.status == "fail" and bad.steps[0].drift_dedup > 0.25


@pytest.mark.parametrize(
    "bug,dtype",
    [
        ("wrong_prompt", "float32"),
        ("positions_restart", "float32"),
        ("first_label_shared", "float32"),
        ("first_label_dropped", "bfloat16"),
    ],
)
def test_training_with_a_broken_plan_diverges(bug, dtype):
    res = verify_training(TrainConfig(dtype=dtype, steps=1), bug=bug)
    assert res.status == "fail" and res.steps[0].drift_dedup > 0.25 and "step 1" in res.reason


def test_unavailable_and_bad_configs():
    assert (
        verify_training(
            TrainConfig(actor=ActorConfig(attn_implementation="flash_attention_2"), dtype="bfloat16")
        ).status
        == "skip"
    )
    with pytest.raises(ValueError, match="steps"):
        verify_training(TrainConfig(steps=0))
