"""DeepSeek-V3 (MLA + MoE) and GLM-4-MoE against the per-sequence float64 reference.

DeepSeek-V3's attention is MLA: low-rank q (q_lora_rank) and kv (kv_lora_rank) projections,
interleaved rope on a 8-dim slice, query/key heads of qk_nope + qk_rope = 24 dims and value heads
of 12 (Dv != Dq reaches the hook), and yarn's mscale folded into the `scaling` the hook gets. Its
MoE (and GLM-4-MoE's): sigmoid scores plus the router's `e_score_correction_bias` buffer (set to
random values here so it decides routes), group-limited top-k, routed_scaling_factor, shared
experts, the first layer dense. All of it is token-wise; neither family computes a router aux loss
in transformers, so zorro computes none. The router casts to float32 upstream (its weight is kept
in float32 even in a float64 model), which sets the float64 floor here (~3e-8 log-prob, ~4e-7
relative gradient, measured), under LP_ATOL / GRAD_RTOL.

Covered: DeduplicatedActor in every mode (split eager/sdpa, mask eager/sdpa/flex), BaselineActor
(packed and padded), padded and unpadded batches, sharing="prompt" and "prefix", gradient
checkpointing, micro-batches; the backends with Dv != Dq (sdpa's CPU flash cross call, and the
CUDA kernels' glue through contract stand-ins that refuse unequal head dims as the kernels do).
"""

import copy

import pytest
import torch
from helpers import ACTOR_BATCHES, LP_ATOL, MODES, check, mixed_batch
from test_checkpointing import checkpointing
from test_microbatch import check_micro_batches
from test_trie_actor import BATCHES as TREE_BATCHES
from varlen_standins import Calls, install_flash_attn, install_torch_varlen

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.attention.backends import BACKENDS, backend_unavailable
from zorro_core.attention.head_dims import crop, same_head_dim
from zorro_core.attention.padded import cpu_flash_unavailable
from zorro_core.models.moe import is_moe, routed_experts
from zorro_core.models.parts import model_parts
from zorro_core.models.presets import build_model, preset_config
from zorro_core.plan.segments import Segments, cu_seqlens
from zorro_core.verify.gradients import Errors, judge
from zorro_core.verify.reference import actor_run, max_abs_error, per_sequence, rel_grad_errors, token_weights

FAMILIES = ["tiny-deepseek-v3", "tiny-glm4-moe"]
TEMPERATURE = 0.8
# every route the hook has in mask/split mode: the helpers' four, plus flex mask mode (eager on CPU)
ALL_MODES = MODES + [(False, "flex_attention")]


def _randomize_router_bias(model: torch.nn.Module, seed: int) -> None:
    """e_score_correction_bias is a buffer, zeros at init: random values make it decide routes."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            b = m.e_score_correction_bias
            b.copy_((torch.rand(b.shape, generator=g, dtype=torch.float64) - 0.5).to(b.dtype) * 0.1)


@pytest.fixture(scope="module")
def models():
    """float64 models of this module (checkpointing switches them to train mode and back)."""
    cache = {}

    def get(family, **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in cache:
            m = build_model(preset_config(family, **overrides), dtype=torch.float64, attn_implementation="eager")
            _randomize_router_bias(m, seed=1)
            cache[key] = m
        return cache[key]

    return get


BATCHES = {**ACTOR_BATCHES, **{f"prefix_{k}": v for k, v in TREE_BATCHES.items() if k in ("tree", "system_padded")}}


@pytest.fixture(scope="module")
def references(models):
    cache = {}

    def get(family, batch_name, **overrides):
        key = (family, batch_name, repr(sorted(overrides.items())))
        if key not in cache:
            batch = BATCHES[batch_name]()
            w = token_weights(batch, seed=1)
            cache[key] = (batch, w, per_sequence(models(family, **overrides), batch, TEMPERATURE, w))
        return cache[key]

    return get


# ---------------------------------------------------------------- the shapes are what the tests claim


def test_tiny_presets_have_the_features_under_test(models):
    ds, glm = models("tiny-deepseek-v3"), models("tiny-glm4-moe")
    attn = ds.model.layers[0].self_attn
    assert attn.qk_head_dim != attn.v_head_dim and attn.q_lora_rank and attn.config.rope_interleave
    assert attn.scaling != attn.qk_head_dim**-0.5  # yarn's mscale: the hook must use the layer's scaling
    for m in (ds, glm):
        kinds = [type(layer.mlp).__name__ for layer in m.model.layers]
        assert kinds[0].endswith("MLP") and kinds[1].endswith("MoE"), kinds  # one dense, one MoE layer
        assert m.config._experts_implementation == "eager"  # float64: grouped_mm has no kernel
        assert routed_experts(m.config) == m.config.n_routed_experts and not is_moe(m.config)
        assert not model_parts(m).moe  # no aux loss to weight
    assert glm.config.use_qk_norm and glm.config.attention_bias
    # the router's correction bias is a buffer in this transformers (no gradient to compare), its weight a parameter
    for m in (ds, glm):
        names = dict(m.named_parameters())
        assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.gate.e_score_correction_bias" in dict(
            m.named_buffers()
        )
    assert glm.config.rope_parameters["partial_rotary_factor"] == 0.5


def test_the_router_bias_decides_routes(models):
    """The bias set by the fixture changes which experts tokens go to (so the tests exercise it): the
    MoE block's output moves when it is zeroed (read through the block, whose router API differs
    between transformers releases)."""
    for family in FAMILIES:
        mlp = models(family).model.layers[1].mlp
        gate = mlp.gate
        h = torch.randn(1, 64, gate.weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        with torch.no_grad():
            chosen = mlp(h)
            bias = gate.e_score_correction_bias.clone()
            gate.e_score_correction_bias.zero_()
            unbiased = mlp(h)
            gate.e_score_correction_bias.copy_(bias)
        assert not torch.allclose(chosen, unbiased), family


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize("split,attn", ALL_MODES)
@pytest.mark.parametrize("batch_name", list(ACTOR_BATCHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_dedup_matches_per_sequence(models, references, family, batch_name, split, attn):
    batch, w, ref = references(family, batch_name)
    out = check(
        DeduplicatedActor(model=models(family), use_split_attention=split, attn_implementation=attn),
        batch,
        w,
        ref,
        TEMPERATURE,
    )
    assert out.aux_loss is None and out.plan.num_tokens < out.plan.logical_tokens


@pytest.mark.parametrize("padded,attn", [(False, "eager"), (False, "sdpa"), (True, "eager"), (True, "sdpa")])
@pytest.mark.parametrize("batch_name", ["mixed", "dummy_unpadded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_baseline_matches_per_sequence(models, references, family, batch_name, padded, attn):
    batch, w, ref = references(family, batch_name)
    check(BaselineActor(model=models(family), padded=padded, attn_implementation=attn), batch, w, ref, TEMPERATURE)


@pytest.mark.parametrize("split,attn", ALL_MODES)
@pytest.mark.parametrize("batch_name", ["prefix_tree", "prefix_system_padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_sharing_matches_per_sequence(models, references, family, batch_name, split, attn):
    batch, w, ref = references(family, batch_name)
    actor = DeduplicatedActor(
        model=models(family), use_split_attention=split, attn_implementation=attn, sharing="prefix", min_shared_tokens=1
    )
    out = check(actor, batch, w, ref, TEMPERATURE)
    assert out.plan.sharing == "prefix" and out.plan.depth >= 2


VARIANTS = {
    # Moonlight-16B's variant of DeepSeek-V3: q_proj instead of q_lora, default rope, one expert group
    "tiny-deepseek-v3": dict(
        q_lora_rank=None, n_group=1, topk_group=1, rope_parameters={"rope_type": "default", "rope_theta": 5e4}
    ),
    # GLM-4.5-Air's: no qk-norm; and no attention bias
    "tiny-glm4-moe": dict(use_qk_norm=False, attention_bias=False),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_published_variants(models, references, family):
    kw = VARIANTS[family]
    model = models(family, **kw)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj is not None) if family == "tiny-deepseek-v3" else not hasattr(attn, "q_norm")
    for split, attn_impl in [(True, "sdpa"), (False, "eager")]:
        batch, w, ref = references(family, "dummy_padded", **kw)
        actor = DeduplicatedActor(model=model, use_split_attention=split, attn_implementation=attn_impl)
        check(actor, batch, w, ref, TEMPERATURE)


def test_a_hook_that_drops_the_layer_scaling_is_caught(models, references, monkeypatch):
    """yarn's mscale reaches the hook as `scaling`: a hook using head_dim ** -0.5 instead fails the comparison."""
    import zorro_core.attention.registration as registration

    real = registration.zorro_attention
    monkeypatch.setattr(registration, "zorro_attention", lambda *a, **kw: real(*a, **{**kw, "scaling": None}))
    batch, w, ref = references("tiny-deepseek-v3", "mixed")
    lp, _, _, _ = actor_run(DeduplicatedActor(model=models("tiny-deepseek-v3")), batch, TEMPERATURE, w)
    assert (lp - ref[0]).abs().max().item() > 100 * LP_ATOL  # tiny random weights: attention near uniform


# ---------------------------------------------------------------- no router aux loss


@pytest.mark.parametrize("family", FAMILIES)
def test_no_aux_loss_even_with_output_router_logits(family):
    """transformers' forward computes no aux loss for these families, so the actors return none."""
    model = build_model(preset_config(family, output_router_logits=True), dtype=torch.float64)
    ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, output_router_logits=True)
    # no loss built (5.24 records the router logits without one; 5.6's outputs have neither field)
    assert getattr(out, "aux_loss", None) is None
    for actor in (DeduplicatedActor(model=model), BaselineActor(model=model, padded=True)):
        assert actor.forward(mixed_batch()).aux_loss is None


# ---------------------------------------------------------------- checkpointing, micro-batches


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("layout", ["dummy_padded", "dummy_unpadded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_actors_match_per_sequence(models, references, family, layout, reentrant):
    model = models(family)
    batch, w, ref = references(family, layout)  # computed without checkpointing, in eval mode
    actors = [
        lambda: DeduplicatedActor(model=model, use_split_attention=True, attn_implementation="sdpa"),
        lambda: DeduplicatedActor(model=model, use_split_attention=False, attn_implementation="eager"),
        lambda: DeduplicatedActor(model=model, sharing="prefix", min_shared_tokens=1),
        lambda: BaselineActor(model=model, attn_implementation="eager", padded=True),
    ]
    with checkpointing(model, reentrant):
        for make in actors:
            check(make(), batch, w, ref, TEMPERATURE)


@pytest.mark.parametrize("budget", [12, 1])
@pytest.mark.parametrize("actor_kind", ["dedup", "dedup-prefix", "baseline-padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batches_equal_full_batch(models, family, actor_kind, budget):
    model = models(family)
    actor = {
        "dedup": lambda: DeduplicatedActor(model=model),
        "dedup-prefix": lambda: DeduplicatedActor(model=model, sharing="prefix", min_shared_tokens=1),
        "baseline-padded": lambda: BaselineActor(model=model, padded=True),
    }[actor_kind]()
    res = check_micro_batches(actor, model, mixed_batch(), budget)
    assert len(res.partition.parts) > 1


# ---------------------------------------------------------------- backends with Dv != Dq


def _segments(lens_q, lens_k, device="cpu"):
    lq, lk = torch.tensor(lens_q), torch.tensor(lens_k)
    return Segments(
        0,
        torch.arange(int(lk.sum()), device=device),
        cu_seqlens(lq).to(device),
        cu_seqlens(lk).to(device),
        max(lens_q),
        max(lens_k),
        lens_q == lens_k,
        int(lq.sum()),
        int(lk.sum()),
    )


def _qkv(t, dq, dv, dtype=torch.float64, hq=4, hkv=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(t, h, d, generator=g, dtype=torch.float64).to(dtype) for h, d in ((hq, dq), (hkv, dq), (hkv, dv))
    ]


@pytest.mark.parametrize("dq,dv", [(24, 12), (8, 20)])
def test_same_head_dim_pads_exactly(dq, dv):
    """Zero padding to one head dim, then the crop: output and all three gradients equal unpadded attention."""
    q, k, v = (x.requires_grad_() for x in _qkv(9, dq, dv))
    seg = _segments([4, 5], [4, 5])
    ref = BACKENDS["reference"]
    out = ref.varlen(q, k, v, seg, 0.3)
    qp, kp, vp, d = same_head_dim(q, k, v)
    assert qp.shape[-1] == kp.shape[-1] == vp.shape[-1] == max(dq, dv) and d == dv
    padded = crop(ref.varlen(qp, kp, vp, seg, 0.3), d)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.autograd.grad(out, (q, k, v), g)
    got = torch.autograd.grad(padded, (q, k, v), g)
    assert out.shape[-1] == dv and torch.allclose(padded, out, atol=1e-13, rtol=0)
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("dq,dv", [(24, 12), (8, 20)])
def test_sdpa_backend_causal_and_cross_with_unequal_head_dims(dq, dv, dtype):
    """The sdpa backend's causal call (F.sdpa) and cross call (the CPU flash op, which refuses unequal dims
    unpadded) against the reference backend, forward and backward."""
    prompt, resp = [6, 3], [[2, 4], [1, 5, 3]]
    from zorro_core import RolloutBatch
    from zorro_core.plan.build import build_dedup_plan

    batch = RolloutBatch.from_lists(
        [list(range(1, 1 + p)) for p, rs in zip(prompt, resp) for _ in rs],
        [list(range(1, 1 + r)) for rs in resp for r in rs],
    )
    plan = build_dedup_plan(batch)
    assert plan.cross is not None
    t = plan.num_tokens
    q, k, v = (x.requires_grad_() for x in _qkv(t, dq, dv, dtype))
    outs, grads = {}, {}
    g = torch.randn(t, 4, dv, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    for name in ("reference", "sdpa"):
        be = BACKENDS[name]
        tc = plan.causal.total_q
        out = torch.cat([be.causal(q[:tc], k[:tc], v[:tc], plan.causal, 0.3), be.cross(q[tc:], k, v, plan.cross, 0.3)])
        outs[name] = out
        grads[name] = torch.autograd.grad(out, (q, k, v), g)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert cpu_flash_unavailable(dtype) is None  # the cross call above went through the CPU flash op
    assert outs["sdpa"].shape == (t, 4, dv)
    assert (outs["sdpa"] - outs["reference"]).abs().max().item() < tol
    for a, b in zip(grads["sdpa"], grads["reference"]):
        assert (a - b).abs().max().item() < tol


@pytest.mark.parametrize("install,fn", [(install_flash_attn, "flash_attn"), (install_torch_varlen, "torch_varlen")])
@pytest.mark.parametrize("dq,dv", [(24, 12), (8, 16)])
def test_cuda_varlen_glue_pads_unequal_head_dims(kernel_emulation, monkeypatch, install, fn, dq, dv):
    """flash_attn / torch_varlen need one head dim (the emulated kernels refuse others, as the compiled
    ones do): the backend pads and crops, and its varlen and cross calls equal the reference on the
    same bf16 inputs."""
    calls = Calls()
    install(kernel_emulation, monkeypatch, calls)
    q, k, v = _qkv(15, dq, dv, torch.bfloat16)
    cu = torch.tensor([0, 15], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="shape|head"):  # the contract, unpadded
        if fn == "flash_attn":
            from flash_attn import flash_attn_varlen_func

            flash_attn_varlen_func(q, k, v, cu, cu, 15, 15, causal=True)
        else:
            from torch.nn.attention.varlen import varlen_attn

            varlen_attn(q, k, v, cu, cu, 15, 15, window_size=(-1, 0), enable_gqa=True)
    calls.n = 0
    seg = _segments([5, 10], [5, 10])
    out = BACKENDS[fn].varlen(q, k, v, seg, 0.3)
    ref = BACKENDS["reference"].varlen(q.double(), k.double(), v.double(), seg, 0.3)
    assert calls.n == 1 and out.shape == ref.shape == (15, 4, dv)
    assert (out.double() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen", "sdpa"])
def test_cuda_kernels_with_unequal_head_dims(backend):
    """On a GPU, the real kernels with MLA's head dims (192 / 128) against the reference backend."""
    why = backend_unavailable(backend, "cuda") if torch.cuda.is_available() else "needs a CUDA device"
    if why:
        pytest.skip(f"{backend} with Dv != Dq: {why} (the glue is covered on CPU over the kernels' emulation)")
    q, k, v = (x.cuda() for x in _qkv(15, 192, 128, torch.bfloat16))
    seg = _segments([5, 10], [5, 10], "cuda")
    out = BACKENDS[backend].varlen(q, k, v, seg, 192**-0.5)
    ref = BACKENDS["reference"].varlen(q.double(), k.double(), v.double(), seg, 192**-0.5)
    assert out.shape == ref.shape == (15, 4, 128)
    assert (out.double() - ref).abs().max().item() < 2e-2


def _errors(actor, batch, w, ref) -> Errors:
    lp, ent, grads, _ = actor_run(actor, batch, 1.0, w)
    return Errors(max_abs_error(lp, ref[0]), max_abs_error(ent, ref[1]), rel_grad_errors(grads, ref[2]))


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_mla_through_the_cuda_backends_end_to_end(models, kernel_emulation, monkeypatch, backend, sharing):
    """tiny-deepseek-v3 in bfloat16 through the CUDA backends' glue (the kernels' CPU emulation): dedup's error
    against the float64 reference is within `zorro verify`'s rule of the baseline's (same backend)."""
    m64 = models("tiny-deepseek-v3")
    batch = (TREE_BATCHES["tree"] if sharing == "prefix" else mixed_batch)()
    w = token_weights(batch, seed=1)
    ref = per_sequence(m64, batch, 1.0, w)
    calls = Calls()
    (install_flash_attn if backend == "flash_attn" else install_torch_varlen)(kernel_emulation, monkeypatch, calls)
    model = copy.deepcopy(m64).to(torch.bfloat16)
    kw = dict(model=model, attn_implementation="sdpa", varlen_backend=backend)
    base = _errors(BaselineActor(**kw), batch, w, ref)
    extra = dict(sharing="prefix", min_shared_tokens=1) if sharing == "prefix" else {}
    dedup = _errors(DeduplicatedActor(**kw, **extra), batch, w, ref)
    assert calls.n >= 2 * model.config.num_hidden_layers  # every layer through the emulated kernel, both arms
    _, check_name, failing = judge("bfloat16", dedup, base)
    assert not failing, f"{check_name}: {failing[:3]}"
    assert dedup.log_prob < 0.2


# ---------------------------------------------------------------- cost model and memory guards


@pytest.mark.parametrize(
    "name",
    [
        "tiny-deepseek-v3",
        "small-deepseek-v3",
        "tiny-glm4-moe",
        "small-glm4-moe",
        "tiny-qwen3-moe",
        "deepseek-ai/DeepSeek-V3",
        "moonshotai/Moonlight-16B-A3B",
        "zai-org/GLM-4.5-Air",
        "Qwen/Qwen3-30B-A3B",
    ],
)
def test_parameter_count_equals_the_models_own(name):
    """The cost model's weights (MLA's low-rank projections, every expert, routers, shared experts)
    equal the model's own matrices, counted on the meta device (671B for DeepSeek-V3, nothing allocated)."""
    from transformers import AutoModelForCausalLM

    from zorro_core.models.registry import model_shape
    from zorro_harness.bench.footprint import parameter_count

    config = preset_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() >= 2)  # norms and biases are 1-D
    shape = model_shape(config)
    assert parameter_count(shape, bool(config.tie_word_embeddings)) == matrices
    if shape.moe_layers < shape.num_layers:  # DeepSeek / GLM: the first layer is dense
        dense = model.model.layers[0]
        assert shape.linear_params_per_layer == sum(p.numel() for p in dense.parameters() if p.dim() >= 2)
    moe = model.model.layers[-1].mlp
    experts = moe.experts if hasattr(moe, "experts") else None
    if experts is not None:  # active: the router, top-k of the routed experts, the shared ones
        per_expert = sum(p.numel() for p in experts.parameters()) // shape.num_experts
        idle = (shape.num_experts - shape.experts_per_token) * per_expert * shape.moe_layers
        assert shape.linear_params(active=True) == shape.linear_params() - idle
    if name == "deepseek-ai/DeepSeek-V3":  # the published figures: 671B total, 37B activated
        embeddings = 2 * shape.vocab_size * shape.hidden_size
        assert round(matrices / 1e9) == 671 and 36.5e9 < shape.linear_params(active=True) + embeddings < 37.9e9
        assert (shape.head_dim, shape.value_head_dim, shape.moe_layers) == (192, 128, 58)


def test_attention_flops_count_the_query_and_value_head_dims():
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import ForwardWork, flops, shape_workloads

    shape = model_shape(preset_config("deepseek-ai/DeepSeek-V3"))
    f = flops(shape, ForwardWork(tokens=10, attended_pairs=30, logit_positions=5))
    assert f.attention == 2 * 128 * (192 + 128) * 61 * 30  # QK^T over 192 dims, PV over 128
    assert f.linear == 2 * shape.linear_params(active=True) * 10
    base, dedup = shape_workloads([1000], [8], [[100] * 8])
    from zorro_core.plan.cost import compare

    cmp = compare(shape, base, dedup)
    assert cmp.component_speedup("linear") == pytest.approx(base.tokens / dedup.tokens)
    assert 1 < cmp.ideal_speedup() < base.tokens / dedup.tokens


def test_memory_guards_count_every_expert():
    from zorro_core.models.registry import model_shape
    from zorro_harness.bench.footprint import activation_widths, case_footprint
    from zorro_harness.bench.guard import verify_too_large
    from zorro_harness.bench.suite import Case

    why = verify_too_large(["deepseek-ai/DeepSeek-V3"], available=2**40)  # 1 TiB is not enough for 671B x 20 B
    assert why is not None and "671B parameters" in why
    assert verify_too_large(["tiny-deepseek-v3", "tiny-glm4-moe"], available=2**30) is None
    case = Case(model="small-deepseek-v3", batch_size=8, num_unique_prompts=2, prompt_len=64, response_len=16)
    config = preset_config(case.model)
    shape = model_shape(config)
    in_flight, saved = activation_widths(shape)
    h = shape.hidden_size
    assert in_flight == min(h + 2 * shape.intermediate_size, h + 2 * shape.shared_intermediate_size)
    assert saved == (h + 2 * shape.intermediate_size) + 3 * (
        h + 2 * shape.shared_intermediate_size + 2 * shape.experts_per_token * shape.moe_intermediate_size
    )
    fwd = case_footprint(case, config, ("forward",))
    both = case_footprint(case, config, ("forward", "forward_backward"))
    assert fwd.activations == 8 * 80 * in_flight * 4 and both.activations == 8 * 80 * saved * 4
    model = build_model(config)
    assert fwd.weights == 4 * sum(p.numel() for p in model.parameters() if p.dim() >= 2)


@pytest.mark.parametrize("name", ["small-deepseek-v3", "small-glm4-moe"])
def test_small_bench_presets_run(name):
    """The CPU-bench shapes (suites/families.toml) build and run through the actor, as the bench runs them."""
    model = build_model(preset_config(name), dtype=torch.float32)
    with torch.no_grad():
        out = DeduplicatedActor(model=model).forward(mixed_batch())
    assert torch.isfinite(out.log_probs).all() and out.aux_loss is None
