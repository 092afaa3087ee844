"""The FLOP cost model against independent counts: the plan's own attention mask, the model's
own parameters, and the DESIGN's worked example."""

import pytest
import torch
from helpers import mixed_batch

from zorro_core import build_dedup_plan, create_dummy_batch
from zorro_core.models.presets import build_model, preset_config
from zorro_core.models.registry import model_shape
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
    shape = model_shape(config)
    assert shape.linear_params_per_layer == counted
    assert shape.vocab_size == model.lm_head.out_features


def test_moe_without_a_dense_width_counts_the_experts_a_token_runs():
    """Qwen3.5-MoE has no intermediate_size: every layer is MoE, and a token's MLP parameters are the
    router, its top-k experts' and the shared expert's (what its FLOPs count)."""
    config = preset_config("Qwen/Qwen3.5-35B-A3B")
    shape = model_shape(config)
    assert shape.moe_layers == config.num_hidden_layers and shape.intermediate_size == 0
    h = config.hidden_size
    assert shape.moe_mlp_params(active=True) == h * 256 + 3 * h * (8 * 512 + 512)
    assert model_shape(preset_config("Qwen/Qwen3.5-27B")).intermediate_size == 17408


def test_design_example():
    """10K prompt, 10 responses of 1K: 110K tokens, 20K unique; linear work 5.5x less."""
    shape = model_shape(preset_config("Qwen/Qwen3-8B"))
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
    shape = model_shape(preset_config("tiny-qwen3"))
    cmp = compare_plans(shape, build_dedup_plan(batch, dedup=False), build_dedup_plan(batch), "none")
    assert cmp.ideal_speedup("forward") == pytest.approx(1.0)
    assert cmp.ideal_speedup("forward_backward") == pytest.approx(1.0)


# `zorro analyze` is arithmetic, in constant time, equal to the per-response sums.
@pytest.mark.parametrize("logits_mode", ["compute", "none"])
def test_uniform_workloads_equal_the_per_group_sums(logits_mode):
    from zorro_core.plan.cost import shape_workloads, uniform_workloads

    for p, g, n, r in [(1, 1, 1, 1), (7, 3, 1, 2), (5, 2, 4, 3), (128, 4, 8, 16)]:
        expected = shape_workloads([p] * g, [n] * g, [[r] * n] * g, logits_mode)
        assert uniform_workloads(p, g, n, r, logits_mode) == expected


@pytest.mark.parametrize("logits_mode", ["compute", "none"])
def test_shared_prefix_workload_equals_the_tree_of_its_nodes(logits_mode):
    from zorro_core.plan.cost import shared_prefix_workload, tree_workload

    for p, g, n, r, h in [(4, 1, 1, 2, 0), (9, 3, 1, 2, 4), (9, 3, 5, 2, 4), (6, 2, 3, 1, 0), (16, 4, 8, 5, 15)]:
        head = h if g > 1 else 0
        nodes = [(0, head)] if head else []
        for _ in range(g):
            nodes += [(head, p + r - head)] if n == 1 else [(head, p - head)] + [(p, r)] * n
        tokens = sum(length for _, length in nodes)
        expected = tree_workload(nodes, tokens if logits_mode == "none" else g * n * r)
        assert shared_prefix_workload(p, g, n, r, h, logits_mode) == expected


def test_analyze_of_huge_workloads_takes_no_time():
    import time

    from zorro_core.plan.cost import shared_prefix_workload, uniform_workloads

    t0 = time.perf_counter()
    base, dedup = uniform_workloads(10_000, 10**6, 10**9, 1_000)
    tree = shared_prefix_workload(10_000, 10**6, 10**9, 1_000, 2_000)
    assert time.perf_counter() - t0 < 0.1
    assert base.tokens == 10**15 * 11_000 and dedup.tokens == 10**6 * (10_000 + 10**12)
    assert tree.tokens < dedup.tokens


def test_analyze_refuses_a_workload_too_large_for_floats():
    from zorro_harness.analyze.analysis import workload_report

    with pytest.raises(ValueError, match="too large"):
        workload_report(prompt_len=10**160, responses=10, response_len=10, model="tiny-qwen3")


def test_linear_attention_layers_are_counted_as_such():
    """Qwen3-Next: gated DeltaNet layers have their own projections and no attended pairs; their
    delta rule costs per token it runs, the replayed partial chunks included."""
    config = preset_config("tiny-qwen3-next")
    shape = model_shape(config)
    assert (shape.num_layers, shape.num_linear_layers) == (2, 1)
    model = build_model(config)
    gdn = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    projections = sum(m.weight.numel() for m in gdn.modules() if isinstance(m, torch.nn.Linear))
    assert shape.delta_net_params_per_layer == projections
    assert shape.moe_layers == 2  # Qwen3-Next's MLPs are all MoE: a token runs the router, top-k and shared experts
    work = ForwardWork(tokens=100, attended_pairs=3000, logit_positions=10, replayed_tokens=7)
    f = flops(shape, work)
    assert f.attention == 4 * shape.num_heads * shape.head_dim * 3000 + shape.delta_rule_flops_per_token * 107
    mixers = shape.attention_params_per_layer + shape.delta_net_params_per_layer
    assert f.linear == 2 * (mixers + 2 * shape.moe_mlp_params(active=True)) * 100
    assert model_shape(preset_config("tiny-qwen3")).num_linear_layers == 0


@pytest.mark.parametrize("p", [10, 64, 70, 130])
def test_shape_workloads_count_the_replayed_tails(p):
    """The prompt plan replays a shared prompt's tail past its last chunk boundary once per extra
    response; the closed forms and the plan agree."""
    batch = create_dummy_batch(batch_size=6, num_unique_prompts=2, prompt_len=p, response_len=3, vocab_size=128, seed=1)
    base, dedup = shape_workloads([p] * 2, [3, 3], [[3] * 3] * 2)
    assert base.replayed_tokens == 0 and dedup.replayed_tokens == 2 * 2 * (p % 64)
    plan_work = plan_workload(build_dedup_plan(batch))
    assert dedup == plan_work and dedup.replayed_tokens == plan_work.replayed_tokens


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3", "tiny-gemma3", "tiny-olmo3"])
def test_softmax_attention_params_are_the_models_own(preset):
    """A softmax attention layer's projections as counted equal the model's own weight matrices
    (Qwen3-Next and Qwen3.5: q_proj twice as wide, for the output gate)."""
    config = preset_config(preset)
    model = build_model(config)
    attn = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    counted = sum(m.weight.numel() for m in attn.modules() if isinstance(m, torch.nn.Linear))
    assert model_shape(config).attention_params_per_layer == counted
