"""The FLOP cost model against independent counts: the plan's own attention mask, the model's
own parameters, and the DESIGN's worked example."""

import pytest
import torch
from helpers import mixed_batch

from zorro_core import build_dedup_plan, create_dummy_batch
from zorro_core.models.presets import build_model, preset_config
from zorro_core.plan.cost import (
    ForwardWork,
    ModelShape,
    causal_pairs,
    compare,
    compare_plans,
    flops,
    plan_workload,
    shape_workloads,
)


def test_causal_pairs():
    assert causal_pairs(4, 4) == 10  # 1 + 2 + 3 + 4
    assert causal_pairs(2, 5) == 4 + 5  # bottom-right: the 2 queries see 4 and 5 keys
    with pytest.raises(ValueError):
        causal_pairs(5, 2)


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize(
    "make",
    [
        mixed_batch,
        lambda: create_dummy_batch(
            batch_size=6, num_unique_prompts=2, prompt_len=12, response_len=6, vocab_size=256, vary_lengths=True, seed=3
        ),
        lambda: create_dummy_batch(
            batch_size=5, num_unique_prompts=1, prompt_len=9, response_len=5, vocab_size=256, seed=4
        ),
    ],
)
def test_attended_pairs_equal_the_plans_mask(make, dedup):
    """Pairs counted from segment lengths == allowed entries of the plan's [T, T] block mask."""
    plan = build_dedup_plan(make(), dedup=dedup)
    assert plan_workload(plan).attended_pairs == int(plan.attention_mask().sum())


@pytest.mark.parametrize("logits_mode", ["none", "compute", "memory"])
@pytest.mark.parametrize("b,u,p,r", [(8, 1, 16, 4), (8, 2, 10, 3), (6, 6, 7, 5), (4, 3, 5, 2)])
def test_shape_workloads_match_plans(b, u, p, r, logits_mode):
    batch = create_dummy_batch(batch_size=b, num_unique_prompts=u, prompt_len=p, response_len=r, vocab_size=128, seed=1)
    sizes = torch.bincount(torch.arange(b) % u).tolist()
    base, dedup = shape_workloads([p] * u, sizes, [[r] * n for n in sizes], logits_mode)
    assert base == plan_workload(build_dedup_plan(batch, dedup=False), logits_mode)
    assert dedup == plan_workload(build_dedup_plan(batch, dedup=True), logits_mode)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "small-qwen3"])
def test_linear_params_per_layer_match_the_model(name):
    config = preset_config(name)
    model = build_model(config)
    layer = model.model.layers[0]
    counted = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    shape = ModelShape.from_config(config)
    assert shape.linear_params_per_layer == counted
    assert shape.vocab_size == model.lm_head.out_features


def test_design_example():
    """10K prompt, 10 responses of 1K: 110K tokens, 20K unique; linear work 5.5x less."""
    shape = ModelShape.from_config(preset_config("Qwen/Qwen3-8B"))
    base, dedup = shape_workloads([10_000], [10], [[1000] * 10])
    assert (base.tokens, dedup.tokens) == (110_000, 20_000)
    assert 1 - dedup.tokens / base.tokens == pytest.approx(0.818, abs=1e-3)
    cmp = compare(shape, base, dedup)
    assert cmp.component_speedup("linear") == pytest.approx(5.5)
    assert cmp.component_speedup("lm_head") == pytest.approx(1.0)  # compute mode: same positions
    assert base.attended_pairs == 10 * causal_pairs(11_000, 11_000)
    assert dedup.attended_pairs == causal_pairs(10_000, 10_000) + 10 * causal_pairs(1000, 11_000)
    assert 1 < cmp.ideal_speedup() < 5.5


def test_flops_formulas_and_phases():
    shape = ModelShape(
        hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=32
    )
    f = flops(shape, ForwardWork(tokens=10, attended_pairs=30, logit_positions=5))
    assert f.linear == 2 * shape.linear_params_per_layer * 2 * 10
    assert f.attention == 4 * 2 * 4 * 2 * 30
    assert f.lm_head == 2 * 8 * 32 * 5
    assert f.forward_backward == 3 * f.forward
    m = flops(shape, ForwardWork(10, 30, 5), logits_mode="memory")
    assert m.forward_backward == 3 * m.forward + m.lm_head  # recompute in backward


def test_no_sharing_is_no_speedup():
    batch = create_dummy_batch(batch_size=4, num_unique_prompts=4, prompt_len=8, response_len=3, vocab_size=64)
    shape = ModelShape.from_config(preset_config("tiny-qwen3"))
    cmp = compare_plans(shape, build_dedup_plan(batch, dedup=False), build_dedup_plan(batch), "none")
    assert cmp.ideal_speedup("forward") == pytest.approx(1.0)
    assert cmp.ideal_speedup("forward_backward") == pytest.approx(1.0)
