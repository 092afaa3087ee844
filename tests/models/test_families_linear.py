"""The gated DeltaNet + full attention families (Qwen3-Next; Qwen3.5 dense and MoE, text models)
against the per-sequence float64 reference.

transformers' PyTorch delta-rule kernel computes in float32 even in a float64 model, which puts
float32 noise (measured ~1.2e-4 relative on A_log's gradient, dedup vs one-shot) on every
gradient through it. The exactness tests therefore run both the reference and zorro with
`chunk_gated_delta_rule_exact` (same algorithm, float64) installed as the family module's kernel;
`test_unmodified_float32_kernel` runs transformers' own kernel at its measured floor.
Prompts cover shorter than one chunk (40), exactly one (64), longer (100) and two chunks (128).
Qwen3.5 also: text positions through its mRoPE, and the multimodal composite taken.
"""

import os
import sys
import types

import pytest
import torch
import transformers
from fla_devices import KERNEL, exact_kernels, family_module, pytorch_delta_rule_on_cpu
from helpers import GRAD_RTOL, LP_ATOL, check
from packaging.version import Version
from versions import skip_module_without_qwen3_next_adapter

import zorro_core
from zorro_core import BaselineActor, DeduplicatedActor, RolloutBatch, create_dummy_batch
from zorro_core.models.linear_attention import (
    _KERNEL_REPEATS_HEADS,
    build_linear_layout,
    conv_sources,
    fla_available,
    layer_function,
    linear_layers,
    uninstall_linear_attention,
)
from zorro_core.plan.build import build_dedup_plan
from zorro_core.verify.delta_rule import chunk_gated_delta_rule_exact
from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

skip_module_without_qwen3_next_adapter()
pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
# Every registry family with gated DeltaNet layers, by its tiny preset.
FAMILIES = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"]


@pytest.fixture(autouse=True)
def _pytorch_kernel_outside_the_actor(monkeypatch):
    """With fla installed, transformers' own forward cannot run on CPU (tests/fla_devices.py): the
    references here get the PyTorch kernel; zorro's own choice is tested in test_fla_device.py."""
    pytorch_delta_rule_on_cpu(monkeypatch)


def _tokens(n, gen):
    return torch.randint(1, 256, (n,), generator=gen).tolist()


def chunk_batch() -> RolloutBatch:
    """Shared prompts of 40, 64, 100 and 128 tokens (duplicates not adjacent), one lone prompt of 70;
    responses from 1 token to long enough that tail + response crosses a chunk boundary."""
    gen = torch.Generator().manual_seed(0)
    a, b, c, d, e = (_tokens(n, gen) for n in (40, 64, 100, 128, 70))
    prompts = [a, b, c, a, e, b, c, d, d, a]
    responses = [_tokens(n, gen) for n in (5, 30, 70, 9, 12, 1, 3, 20, 66, 2)]
    return RolloutBatch.from_lists(prompts, responses)


def boundary_batch() -> RolloutBatch:
    """Prompts one token either side of the first two chunk boundaries, each shared by two rows."""
    gen = torch.Generator().manual_seed(1)
    ps = [_tokens(n, gen) for n in (63, 65, 127, 129)]
    return RolloutBatch.from_lists(ps + ps[::-1], [_tokens(n, gen) for n in (2, 64, 1, 7, 3, 62, 66, 1)])


BATCHES = {
    "chunks_padded": chunk_batch,
    "boundaries": boundary_batch,
    "all_short_shared": lambda: create_dummy_batch(
        batch_size=4, num_unique_prompts=2, prompt_len=20, response_len=8, vocab_size=256, vary_lengths=True, seed=6
    ),
    "unpadded": lambda: create_dummy_batch(
        batch_size=3, num_unique_prompts=1, prompt_len=70, response_len=10, vocab_size=256, seed=5
    ),
}
MODES = [(True, "eager"), (True, "sdpa"), (False, "eager")]


@pytest.fixture
def exact_kernel(monkeypatch):
    exact_kernels(monkeypatch)


@pytest.fixture(scope="module")
def exact_references(tiny_models, per_sequence_reference):
    def get(family, batch_name):
        with pytest.MonkeyPatch.context() as mp:
            exact_kernels(mp)
            return per_sequence_reference(
                (family, batch_name), lambda: tiny_models(family), BATCHES[batch_name], 1.0, seed=2
            )

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_kernel_agrees_with_transformers_kernel(family):
    gen = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 100, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 100, 4, 8, generator=gen, dtype=torch.float64)
    g, beta = (
        -torch.rand(2, 100, 4, generator=gen, dtype=torch.float64),
        torch.rand(2, 100, 4, generator=gen, dtype=torch.float64),
    )
    s0 = torch.randn(2, 4, 8, 8, generator=gen, dtype=torch.float64)
    kw = dict(g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if Version(transformers.__version__) < _KERNEL_REPEATS_HEADS:
        # before 5.23 the layer repeats q/k up to the value heads and the kernel takes equal counts
        q, k = (x.repeat_interleave(2, dim=2) for x in (q, k))
    o_ref, s_ref = getattr(family_module(family), KERNEL)(q, k, v, **kw)
    o, s = chunk_gated_delta_rule_exact(q, k, v, **kw)
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    assert (o - o_ref).abs().max() < 1e-5 and (s - s_ref).abs().max() < 1e-5  # float32 precision of the reference


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("split,attn", MODES)
@pytest.mark.parametrize("actor_cls", [DeduplicatedActor, BaselineActor])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_per_sequence(tiny_models, exact_references, exact_kernel, family, batch_name, split, attn, actor_cls):
    batch, w, ref = exact_references(family, batch_name)
    actor = actor_cls(model=tiny_models(family), use_split_attention=split, attn_implementation=attn)
    out = check(actor, batch, w, ref, 1.0)
    if actor_cls is DeduplicatedActor:
        assert out.plan.num_groups < batch.batch_size


@pytest.mark.parametrize("family", FAMILIES)
def test_unmodified_float32_kernel(tiny_models, family):
    """transformers' own kernel (float32 inside): log-probs at the float64 tolerance; gradients at
    that kernel's measured floor (1.2e-4 relative on A_log, asserted at 1e-3). A lost carried state
    or a wrong conv window is off by >1e-2 (test_carried_state_matters)."""
    model = tiny_models(family)
    batch = chunk_batch()
    w = token_weights(batch, seed=2)
    ref = per_sequence(model, batch, 1.0, w)
    lp, ent, grads, _ = actor_run(DeduplicatedActor(model=model), batch, 1.0, w)
    assert (lp - ref[0]).abs().max().item() < LP_ATOL
    assert (ent - ref[1]).abs().max().item() < LP_ATOL
    assert max_rel_grad_error(grads, ref[2])[0] < 1e-3


@pytest.mark.parametrize("what", ["zero_state", "no_conv_carry", "fork_at_prompt_end"])
@pytest.mark.parametrize("family", FAMILIES)
def test_carried_state_matters(tiny_models, exact_references, exact_kernel, monkeypatch, family, what):
    """Dropping the carried recurrent state or the carried conv inputs fails by orders of magnitude.
    Forking at the prompt's end (no tail replay, a layout chunk of 1) is the same math, so in float64
    it equals the reference too: the replay is about numerics, not correctness. (Measured in float32
    with transformers' kernel, seeds 1-2: boundary fork equals the packed one-shot baseline bitwise,
    fork at the prompt's end differs by 4.8e-7.)"""
    import zorro_core.models.linear_attention as la

    real_layout, real_conv = la.build_linear_layout, la.conv_sources
    if what == "zero_state":

        def layout(plan, chunk=64):
            lay = real_layout(plan, chunk)
            branch = lay.steps[-1]
            branch.state = torch.zeros_like(branch.state)
            return lay

        monkeypatch.setattr(la, "build_linear_layout", layout)
    elif what == "no_conv_carry":

        def conv(plan, k):
            src = real_conv(plan, k).clone()
            is_resp = plan.token_segment >= plan.num_groups
            offset = plan.position_ids - plan.prompt_lens[plan.token_group]
            cut = is_resp[:, None] & (offset[:, None] < torch.arange(k - 1, -1, -1)[None, :])
            return torch.where(cut, plan.num_tokens, src)

        monkeypatch.setattr(la, "conv_sources", conv)
    else:
        monkeypatch.setattr(la, "build_linear_layout", lambda plan, chunk=64: real_layout(plan, 1))
    batch, w, ref = exact_references(family, "chunks_padded")
    lp, ent, grads, _ = actor_run(DeduplicatedActor(model=tiny_models(family)), batch, 1.0, w)
    lp_err = (lp - ref[0]).abs().max().item()
    g_err = max_rel_grad_error(grads, ref[2])[0]
    if what == "fork_at_prompt_end":
        assert lp_err < LP_ATOL and g_err < GRAD_RTOL
    else:
        assert lp_err > 1e3 * LP_ATOL or g_err > 1e3 * GRAD_RTOL, (lp_err, g_err)


def test_layout_forks_at_the_last_chunk_boundary():
    batch = RolloutBatch.from_lists([[1] * 10, [2] * 3, [1] * 10, [3] * 8], [[5, 6], [7], [8, 9, 9], [4]])
    plan = build_dedup_plan(batch)
    lay = build_linear_layout(plan, chunk=4)
    # Packed: prompt A (10) @0, [B + resp1] (3+1) @10, [C + resp3] (8+1) @14, then resp0 (2) @23, resp2 (3) @25.
    head, branch = lay.steps
    assert head.state is None  # from zeros
    assert head.calls.cu.tolist() == [0, 8, 12, 21]  # A up to 8; lone B+r1 and C+r3 whole
    assert head.calls.index[:8].tolist() == list(range(8))
    assert branch.calls.cu.tolist() == [0, 4, 9]  # tail [8,10) + response, per row of A
    assert branch.calls.index.tolist() == [8, 9, 23, 24, 8, 9, 25, 26, 27]
    assert branch.state.tolist() == [1, 1]  # both start from head segment 0's state
    # Every packed token takes its output from exactly one place; A's tail from its first row's branch.
    n_head = head.calls.index.numel()
    assert sorted(lay.out_index.tolist()) == sorted(set(lay.out_index.tolist()))
    assert lay.out_index[8:10].tolist() == [n_head + 0, n_head + 1]
    assert lay.out_index[25:28].tolist() == [n_head + 6, n_head + 7, n_head + 8]


def test_conv_sources_reach_into_the_prompt():
    batch = RolloutBatch.from_lists([[1, 2, 3], [1, 2, 3]], [[4, 5], [6, 7, 8]])
    plan = build_dedup_plan(batch)
    src = conv_sources(plan, 4)
    t = plan.num_tokens  # packed: prompt @0..2, resp0 @3..4, resp1 @5..7; t = zero
    assert src[0].tolist() == [t, t, t, 0]
    assert src[2].tolist() == [t, 0, 1, 2]
    assert src[3].tolist() == [0, 1, 2, 3]  # first token of response 0: prompt's last 3
    assert src[5].tolist() == [0, 1, 2, 5]  # first token of response 1: the same prompt inputs
    assert src[7].tolist() == [2, 5, 6, 7]


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_baseline_is_refused(tiny_models, family):
    from zorro_core.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="linear-attention"):
        BaselineActor(model=tiny_models(family), padded=True).forward(chunk_batch())


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.15)])
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precision_close_to_baseline(family, dtype, atol):
    """transformers' own kernel in float32/bf16: dedup and the packed one-shot baseline agree to the
    dtype's noise (measured 4.8e-7 in float32, 0 in bf16)."""
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config(family), dtype=dtype, attn_implementation="sdpa")
    batch = chunk_batch()
    d = DeduplicatedActor(model=model).forward(batch).log_probs
    b = BaselineActor(model=model).forward(batch).log_probs
    assert (d - b).abs().max().item() < atol


@pytest.mark.skipif(
    not torch.cuda.is_available() or fla_available() is not None,
    reason="flash-linear-attention kernels need CUDA and the fla package",
)
@pytest.mark.parametrize("family", FAMILIES)
def test_fla_varlen_matches_per_sequence_on_gpu(family):
    """GPU: the varlen fla path (one initial state per response) against each sequence alone through
    the unmodified model (which uses fla too). bf16: some fla versions refuse float32."""
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config(family), dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    batch = chunk_batch().to("cuda")
    ref_lp, _, _ = per_sequence(model, batch, 1.0)
    for actor in (DeduplicatedActor(model=model), BaselineActor(model=model)):
        lp = actor.forward(batch).log_probs.cpu()
        assert (lp - ref_lp.float()).abs().max().item() < 0.15


def test_layout_all_prompts_shorter_than_a_chunk():
    plan = build_dedup_plan(BATCHES["all_short_shared"]())
    lay = build_linear_layout(plan)
    (branch,) = lay.steps  # no head: every branch starts from zeros
    assert torch.all(branch.state == 0)
    assert branch.calls.cu.numel() - 1 == plan.batch_size


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_installed_once_and_transparent_without_a_route(family):
    """The adapter gives each gated DeltaNet layer of the model the actor took its own forward, once
    (a second actor adds no layer of wrapping); a plain forward of the model, outside any actor,
    gives the same result as before."""
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager")
    ids = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(3))
    before = model(input_ids=ids).logits
    DeduplicatedActor(model=model).forward(chunk_batch())
    layers = linear_layers(model)
    forwards = [layer.__dict__["forward"] for layer in layers]
    assert layers and all(f.zorro_adapted for f in forwards)
    DeduplicatedActor(model=model)
    assert all(layer.__dict__["forward"] is f for layer, f in zip(layers, forwards))
    assert torch.equal(model(input_ids=ids).logits, before)


def _source_file(f) -> str:
    """Where a module function is defined: its code's file, or for a kernels Func (transformers >= 5.25)
    its module's (kernels sets the Func class's module to the decorated function's)."""
    code = getattr(f, "__code__", None)
    return code.co_filename if code is not None else sys.modules[type(f).__module__].__file__


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_leaves_transformers_and_other_models_untouched(family):
    """transformers' module functions are the originals after an actor took a model (nothing is
    patched process-wide); a second model of the family that no actor took keeps its class's forward
    and runs transformers' code path as before; uninstalling gives the layers their class's forward back."""
    from zorro_core.models.presets import build_model, preset_config

    mod = family_module(family)
    conv, delta = mod.causal_conv1d_fn, mod.torch_chunk_gated_delta_rule
    taken = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager")
    plain = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager", seed=1)
    ids = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(3))
    before = plain(input_ids=ids).logits
    DeduplicatedActor(model=taken).forward(chunk_batch())
    assert mod.causal_conv1d_fn is conv and mod.torch_chunk_gated_delta_rule is delta
    here = os.path.dirname(zorro_core.__file__)  # and none of them is zorro's (from an earlier actor)
    assert not any(_source_file(f).startswith(here) for f in (conv, delta))
    assert all("forward" not in layer.__dict__ for layer in linear_layers(plain))
    assert all(layer.forward.__func__ is type(layer).forward for layer in linear_layers(plain))
    assert torch.equal(plain(input_ids=ids).logits, before)
    uninstall_linear_attention(taken)
    assert all("forward" not in layer.__dict__ for layer in linear_layers(taken))


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_runs_the_module_kernel_of_the_call(monkeypatch, family):
    """The adapted forward looks the module's kernel up at each call: a kernel put into the module
    after the actor took the model is the one that runs (with a route and without)."""
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager")
    actor = DeduplicatedActor(model=model)
    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return chunk_gated_delta_rule_exact(*args, **kwargs)

    monkeypatch.setattr(family_module(family), KERNEL, kernel)
    actor.forward(chunk_batch())
    n_routed = len(calls)
    assert n_routed >= len(linear_layers(model))  # head and branch calls of every layer
    model(input_ids=torch.ones(1, 5, dtype=torch.long))
    assert len(calls) == n_routed + len(linear_layers(model))


@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batches_match_per_sequence(tiny_models, exact_references, exact_kernel, family):
    """forward_backward over micro-batches (a budget that splits groups, their prompt recomputed in
    each part): log-probs, entropy and every accumulated gradient equal the per-sequence reference."""
    batch, (w_lp, w_ent), ref = exact_references(family, "chunks_padded")
    model = tiny_models(family)

    def loss_fn(out, rows):
        return (w_lp[rows] * out.log_probs).sum() + (w_ent[rows] * out.entropy).sum()

    model.zero_grad(set_to_none=True)
    res = DeduplicatedActor(model=model).forward_backward(
        batch, loss_fn, max_tokens_per_micro_batch=150, calculate_entropy=True
    )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert len(res.partition.parts) > 1 and res.partition.split_groups
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL
    assert (res.entropy - ref[1]).abs().max().item() < LP_ATOL
    g_err, g_name = max_rel_grad_error(grads, ref[2])
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e} relative"


# ---------------------------------------------------------------- Qwen3.5: mRoPE, multimodal composite


def _rope_1d(rotary, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain 1-D rope of positions `pos` [T] with the layer's frequencies (no mRoPE sections)."""
    freqs = pos.double()[:, None] * rotary.inv_freq.double()[None, :]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("family", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_text_positions_through_mrope_are_the_1d_rope(tiny_models, monkeypatch, family):
    """The packed row passes 2-D position ids [1, T] restarting per segment: the text model expands
    them to its three mRoPE rows (temporal, height, width) alike and builds none of its own (no
    rope_deltas in the causal LM), so every section gets the same position and the rotary embedding
    is exactly the 1-D rope of each sequence. Distinct height/width rows would change it (the tiny
    preset's mrope_section covers all three), so the check is not vacuous."""
    model = tiny_models(family)
    rotary = model.model.rotary_emb
    seen = []
    real = type(rotary).forward

    def spy(self, x, position_ids):
        seen.append(position_ids.clone())
        return real(self, x, position_ids)

    monkeypatch.setattr(type(rotary), "forward", spy)
    out = DeduplicatedActor(model=model).forward(chunk_batch())
    pos = out.plan.position_ids
    assert len(seen) == 1 and seen[0].shape == (3, 1, pos.numel())
    assert all(torch.equal(row[0], pos) for row in seen[0])
    assert pos.min() == 0 and (pos[1:] < pos[:-1]).any()  # positions restart per packed segment
    x = torch.zeros(1, dtype=torch.float64)
    cos, sin = real(rotary, x, seen[0])
    ref_cos, ref_sin = _rope_1d(rotary, pos, torch.float64)
    assert torch.allclose(cos[0], ref_cos, rtol=0, atol=1e-6) and torch.allclose(sin[0], ref_sin, rtol=0, atol=1e-6)
    mixed = seen[0].clone()
    mixed[1] += 7  # height positions differ from the text positions
    assert (real(rotary, x, mixed)[0][0] - ref_cos).abs().max() > 1e-2


def _tiny_composite(family: str):
    from transformers import AutoConfig

    from zorro_core.models.presets import preset_config

    composite = {"tiny-qwen3.5": "qwen3_5", "tiny-qwen3.5-moe": "qwen3_5_moe"}[family]
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2)
    return AutoConfig.for_model(composite, text_config=preset_config(family).to_dict(), vision_config=vision)


@pytest.mark.parametrize("family", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_multimodal_composite_is_served_and_its_text_model_too(family):
    """Qwen3.5's composite (image/video + text, ForConditionalGeneration) is taken by an actor (its images
    through the vision actor: tests/models/test_vlm_qwen35.py); AutoModelForCausalLM of the same config
    is the text model, which an actor takes too."""
    from transformers import AutoModelForImageTextToText

    from zorro_core.models.parts import model_parts
    from zorro_core.models.presets import build_model

    config = _tiny_composite(family)
    composite = AutoModelForImageTextToText.from_config(config)
    parts = model_parts(composite)
    assert parts.num_linear_layers == 1 and parts.family.model_type == config.model_type
    text = build_model(config, dtype=torch.float64)
    assert text.config.model_type == f"{config.model_type}_text"
    assert DeduplicatedActor(model=text).forward(chunk_batch()).log_probs.isfinite().all()


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_and_delta_rule_reference_write_nothing_outside_their_model(family):
    """After an actor ran (and the float64 and device delta-rule choices were used on its model):
    every attribute of transformers' modeling modules is the same object as before, the layer class's
    forward is transformers', and another model of the family has its layers as built (no instance
    forward, no delta-rule choice) and gives the same logits."""
    from zorro_core.models.linear_attention import delta_rule_of
    from zorro_core.models.presets import build_model, preset_config
    from zorro_core.verify.delta_rule import device_delta_rule, exact_delta_rule, linear_family_modules

    modules = linear_family_modules()
    before = [dict(vars(mod)) for mod in modules]
    taken = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager")
    plain = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager", seed=1)
    cls_forward = type(linear_layers(plain)[0]).__dict__["forward"]
    plain_state = [dict(layer.__dict__) for layer in linear_layers(plain)]
    ids = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(3))
    logits = plain(input_ids=ids).logits
    with exact_delta_rule(taken):
        DeduplicatedActor(model=taken).forward(chunk_batch())
        taken(input_ids=ids, use_cache=False)
    with device_delta_rule(taken), delta_rule_of(taken, lambda kernel, query: kernel):
        DeduplicatedActor(model=taken).forward(chunk_batch())
        taken(input_ids=ids, use_cache=False)
    for mod, was in zip(modules, before):
        now = vars(mod)
        assert now.keys() == was.keys(), mod.__name__
        assert all(now[name] is was[name] for name in was), mod.__name__
    assert type(linear_layers(plain)[0]).__dict__["forward"] is cls_forward
    assert [dict(layer.__dict__) for layer in linear_layers(plain)] == plain_state
    assert torch.equal(plain(input_ids=ids).logits, logits)
    assert all("zorro_delta_rule" not in layer.__dict__ for layer in linear_layers(taken))


@pytest.mark.parametrize("family", FAMILIES)
def test_written_out_layer_equals_transformers_forward_bitwise(family):
    """The adapter's layer computation, run without a route around the module's own kernel, gives
    transformers' forward bitwise (the model's logits and every gradient; a layer alone with a
    padding mask): the reference that runs it (a model under exact_delta_rule) differs from
    transformers' model in the kernel only."""
    from zorro_core.models.linear_attention import delta_rule_of
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager")
    ids = torch.randint(1, 256, (2, 70), generator=torch.Generator().manual_seed(3))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, use_cache=False).logits
        out.pow(2).mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want, want_grads = run()
    with delta_rule_of(model, lambda kernel, query: kernel):
        got, got_grads = run()
    assert torch.equal(got, want)
    assert len(got_grads) == len(want_grads) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))

    layer = linear_layers(model)[0]
    h = torch.randn(2, 70, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 70, dtype=torch.long)
    mask[1, :5] = 0  # left padding: the layer zeroes those tokens' inputs
    want = type(layer).forward(layer, h, attention_mask=mask)
    with delta_rule_of(model, lambda kernel, query: kernel):
        got = layer(h, attention_mask=mask)
    assert torch.equal(got, want)


def _kernel_copies(model):
    """The layers' own kernels Func copies (`use_kernelized_func`), or skip without them."""
    layers = linear_layers(model)
    if not all("_kernel_funcs" in layer.__dict__ for layer in layers):
        pytest.skip("the layers hold no kernels Func copies (the `kernels` package is absent)")
    return layers


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_calls_the_layers_own_kernel_copy(tiny_models, exact_references, exact_kernel, family):
    """With `kernels` (a dependency from transformers 5.25) the class's forward routes each module
    Func to the layer's own copy, where `kernelize` puts a hub kernel. A kernel put into each layer's
    causal_conv1d_fn copy (as kernelize does: the copy's forward on the instance) is the one the adapter
    runs, with a route and without, and the dedup forward still equals the per-sequence reference."""
    model = tiny_models(family)
    calls = []
    for layer in _kernel_copies(model):
        copy = layer_function(layer, "causal_conv1d_fn")
        plain = type(copy).forward

        def counted(self, *args, _plain=plain, **kwargs):
            calls.append(1)
            return _plain(self, *args, **kwargs)

        copy.forward = types.MethodType(counted, copy)
    try:
        batch, w, ref = exact_references(family, "chunks_padded")
        check(DeduplicatedActor(model=model), batch, w, ref, 1.0)
        n = len(linear_layers(model))
        assert len(calls) >= n
        routed = len(calls)
        model(input_ids=torch.ones(1, 5, dtype=torch.long), use_cache=False)
        assert len(calls) == routed + n
    finally:
        for layer in linear_layers(model):
            layer_function(layer, "causal_conv1d_fn").__dict__.pop("forward", None)


@pytest.mark.parametrize("name", ["causal_conv1d_forward", "torch_chunk_gated_delta_rule"])
def test_hub_kernel_the_adapter_cannot_follow_is_refused(name, monkeypatch):
    """A hub kernel in the layer's conv step (5.25's causal_conv1d_forward, which the adapter replaces)
    or a hub delta rule on CPU (kernels-community's fla runs on CUDA only) is refused, never run wrong.
    Against transformers' own module functions: the autouse fixture's CPU dispatcher (where fla is
    installed) is a plain function the layers hold no kernels copy of (issue 60, defect 14)."""
    from zorro_core.errors import UnsupportedModelError
    from zorro_core.models.presets import build_model, preset_config

    monkeypatch.undo()  # no actor-less forward runs here: nothing needs the PyTorch kernel on CPU

    model = build_model(preset_config("tiny-qwen3-next"), dtype=torch.float64, attn_implementation="eager")
    layers = _kernel_copies(model)
    if not hasattr(family_module("tiny-qwen3-next"), name):
        pytest.skip(f"this transformers' module has no {name}")
    for layer in layers:
        copy = layer_function(layer, name)
        assert copy is not getattr(family_module("tiny-qwen3-next"), name)  # the layer's own copy
        copy.forward = types.MethodType(type(copy).forward, copy)  # as kernelize: the copy's forward replaced
    with pytest.raises(UnsupportedModelError, match="hub kernel"):
        DeduplicatedActor(model=model).forward(chunk_batch())
