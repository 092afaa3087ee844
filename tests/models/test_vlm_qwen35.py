"""Qwen3.5 (dense and MoE) with images (issue 48): the vision path with gated DeltaNet layers.

The composite's text decoder interleaves gated DeltaNet layers (recurrent state, causal conv) with
full attention; the vision actor routes them through the linear-attention adapter (its layout
built from the plan, a PromptPlan or the image trie), as the text path does. Every case compares
against each row run alone through the unmodified model with its own pixel_values in float64
(zorro_core.verify.vision_reference): log-probs, entropy and every gradient, the vision tower's
included. Both sides run the float64 delta rule (`exact_delta_rule`): transformers' PyTorch kernel
computes in float32 even in a float64 model (tests/models/test_families_linear.py).

Batches: test_vlm's (several images per prompt, the same text with another image, an image
recurring across groups and as two tensors, a text-only row) and `long_batch`, whose prompts
cross the delta rule's 64-token chunk boundaries with images on either side, so that state is
carried from a prompt's head into its responses.
"""

import dataclasses

import pytest
import torch
from test_vlm import END, IMAGE, START, _errors, prefix_batch, vision_batch

from zorro_core.actor.vision import BaselineVisionLanguageActor, VisionLanguageActor
from zorro_core.models.vision import build_vision_model, tiny_config
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.multimodal import Image, MultimodalBatch
from zorro_core.stack.checkpointing import CHECKPOINTING, enable_checkpointing
from zorro_core.verify.delta_rule import exact_delta_rule
from zorro_core.verify.reference import max_rel_grad_error
from zorro_core.verify.tolerances import GRAD_RTOL, LOGPROB_ATOL

pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
# (use_split_attention, attn_implementation)
MODES = [(True, "sdpa"), (False, "eager")]
AUX_RTOL = 1e-9


def _model(family: str, attn: str = "sdpa"):
    return build_vision_model(tiny_config(family), dtype=torch.float64, attn_implementation=attn)


def _image(g: torch.Generator, h: int, w: int) -> Image:
    return Image(torch.randn(h * w, 24, generator=g, dtype=torch.float64), (1, h, w))


def _ph(img: Image) -> list[int]:
    t, h, w = img.grid_thw
    return [START] + [IMAGE] * (t * h * w // 4) + [END]


def long_batch(seed: int = 0) -> MultimodalBatch:
    """Prompts past the 64-token chunk: p1 (96 tokens: text, d's 64 image tokens, text) for rows 0, 1,
    2 (responses of 3, 40 and 70 tokens: tail + response crosses a boundary); p2 (132: the same first
    text, e, d recurring, text) for rows 3, 4; p1's text with d2 (same grid, other pixels) for row 5;
    a text-only row of 70 tokens."""
    g = torch.Generator().manual_seed(seed)
    d, e, d2 = _image(g, 16, 16), _image(g, 8, 12), _image(g, 16, 16)

    def text(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=g).tolist()

    t1, t2, t3, t4 = text(20), text(8), text(12), text(70)
    p1 = t1 + _ph(d) + t2
    p2 = t1 + _ph(e) + _ph(d) + t3
    rows = [
        (p1, (d,), text(3)),
        (p1, (d,), text(40)),
        (p1, (d,), text(70)),
        (p2, (e, d), text(5)),
        (p2, (e, d), text(66)),
        (t1 + _ph(d2) + t2, (d2,), text(9)),
        (t4, (), text(4)),
    ]
    batch = RolloutBatch.from_lists([r[0] for r in rows], [r[2] for r in rows])
    return MultimodalBatch(batch, tuple(r[1] for r in rows))


BATCHES = {"images": vision_batch, "prefixes": prefix_batch, "long": long_batch}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def _assert_exact(actor, mm):
    with exact_delta_rule(actor.model):
        out, lp_err, ent_err, g_err, g_name, grads = _errors(actor, mm)
    assert lp_err < LOGPROB_ATOL, f"log-prob error {lp_err:.2e}"
    assert ent_err < LOGPROB_ATOL, f"entropy error {ent_err:.2e}"
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e} relative"
    return out, grads


@pytest.mark.parametrize("batch_name", ["images", "long"])
@pytest.mark.parametrize("split,attn", MODES)
def test_qwen3_5_images_shared_once_equal_each_row_alone(family, split, attn, batch_name):
    model = _model(family, attn)
    actor = VisionLanguageActor(model=model, use_split_attention=split)
    mm = BATCHES[batch_name]()
    out, grads = _assert_exact(actor, mm)
    assert out.plan.num_groups < mm.batch.batch_size
    assert any(n.startswith("model.visual.") for n in grads), "the vision tower got no gradient"
    assert any(".linear_attn." in n for n in grads), "the gated DeltaNet layers got no gradient"


@pytest.mark.parametrize("batch_name", ["prefixes", "long"])
@pytest.mark.parametrize("split,attn", MODES)
def test_qwen3_5_prefix_sharing_with_images_equals_each_row_alone(family, split, attn, batch_name):
    model = _model(family, attn)
    actor = VisionLanguageActor(model=model, sharing="prefix", min_shared_tokens=1, use_split_attention=split)
    mm = BATCHES[batch_name]()
    out, grads = _assert_exact(actor, mm)
    assert out.plan.sharing == "prefix"
    assert out.plan.num_tokens < VisionLanguageActor(model=model)(mm).plan.num_tokens
    assert any(n.startswith("model.visual.") for n in grads)


def test_qwen3_5_plain_vision_actor_equals_each_row_alone(family):
    _assert_exact(BaselineVisionLanguageActor(model=_model(family)), long_batch(1))


@pytest.mark.parametrize("flavour", CHECKPOINTING)
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_qwen3_5_checkpointing_and_a_frozen_vision_tower(family, sharing, flavour):
    model = _model(family)
    enable_checkpointing(model, flavour)
    model.train()
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    _, grads = _assert_exact(VisionLanguageActor(model=model, sharing=sharing, min_shared_tokens=1), long_batch(2))
    assert not any(n.startswith("model.visual.") for n in grads)


def test_qwen3_5_each_distinct_image_goes_through_the_vision_tower_once():
    model = _model("qwen3_5")
    seen = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["grid_thw"].shape[0]), with_kwargs=True
    )
    with exact_delta_rule(model):
        VisionLanguageActor(model=model)(long_batch())
        VisionLanguageActor(model=model, sharing="prefix", min_shared_tokens=1)(long_batch())
    assert seen == [3, 3]  # d, e and d2: d recurs in two prompts


def _row_router_logits(model, mm: MultimodalBatch):
    """Per layer, the router logits of every row run alone through the unmodified composite."""
    prompts, responses = mm.batch.to_lists()
    layers = None
    for p, r, images in zip(prompts, responses, mm.images):
        x = torch.tensor([p + r])
        kwargs = {}
        if images:
            kwargs = dict(
                pixel_values=torch.cat([i.pixel_values for i in images]),
                image_grid_thw=torch.tensor([i.grid_thw for i in images]),
            )
        types = (x == IMAGE).long()
        out = model(input_ids=x, mm_token_type_ids=types, use_cache=False, output_router_logits=True, **kwargs)
        layers = layers or [[] for _ in out.router_logits]
        for acc, logits in zip(layers, out.router_logits):
            acc.append(logits)
    return tuple(torch.cat(x) for x in layers)


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_qwen3_5_moe_aux_loss_with_images_equals_each_row_alone(sharing):
    """The router aux loss (multiplicity weights, the default) of a shared image batch is the loss of
    every row's tokens run alone, and so is its gradient (the vision tower's included)."""
    from zorro_core.models.moe import load_balancing_loss

    model = _model("qwen3_5_moe")
    cfg = model.config.text_config
    mm = long_batch()
    with exact_delta_rule(model):
        ref = load_balancing_loss(_row_router_logits(model, mm), cfg.num_experts, cfg.num_experts_per_tok)
        ref_grads = _grads(model, ref)
        actor = VisionLanguageActor(model=model, sharing=sharing, min_shared_tokens=1)
        assert actor(mm).aux_loss is None  # off unless asked for, as for text
        aux = actor(mm, router_aux_loss=True).aux_loss
    assert abs(aux.item() - ref.item()) < AUX_RTOL * ref.item(), (aux.item(), ref.item())
    g_err, g_name = max_rel_grad_error(_grads(model, aux), ref_grads)
    assert g_err < GRAD_RTOL, f"aux-loss gradient of {g_name} off by {g_err:.2e}"
    assert any(n.startswith("model.visual.") for n in ref_grads)


def test_qwen3_5_planted_bugs_fail_by_orders_of_magnitude(monkeypatch):
    """The proof sees the gated DeltaNet route and the 3-D positions: the conv window left to the packed
    row's neighbours, the responses started from a zero state (no carried prompt), or 1-D text
    positions each fail by > 100x a tolerance. (Measured: log-probs off by 2.1e-2, 8.3e-6
    and 2.8e-2, gradients by 0.64, 8.6e-3 and 0.66 relative.)"""
    import zorro_core.actor.vision as vision_actor
    import zorro_core.models.linear_attention as la

    mm = long_batch()
    model = _model("qwen3_5")

    def errors():
        with exact_delta_rule(model):
            return _errors(VisionLanguageActor(model=model), mm)[1:4]

    with monkeypatch.context() as m:
        m.setattr(la, "_conv_fixes", lambda plan, k: (la.conv_sources(plan, k), torch.zeros(0, dtype=torch.long)))
        lp_err, _, g_err = errors()
        assert lp_err > 1e2 * LOGPROB_ATOL or g_err > 1e2 * GRAD_RTOL, (lp_err, g_err)
    real_layout = la.build_linear_layout

    def stateless(plan, chunk=64):
        lay = real_layout(plan, chunk)
        return dataclasses.replace(lay, steps=[dataclasses.replace(s, state=None) for s in lay.steps])

    with monkeypatch.context() as m:
        m.setattr(la, "build_linear_layout", stateless)
        lp_err, _, g_err = errors()
        assert lp_err > 1e2 * LOGPROB_ATOL or g_err > 1e2 * GRAD_RTOL, (lp_err, g_err)
    with monkeypatch.context() as m:
        m.setattr(vision_actor, "mrope_positions", lambda plan, *a: plan.position_ids.expand(3, -1))
        lp_err, _, g_err = errors()
        assert lp_err > 1e2 * LOGPROB_ATOL or g_err > 1e2 * GRAD_RTOL, (lp_err, g_err)


def test_qwen3_5_text_only_batches_through_the_composite(family):
    """A RolloutBatch (no images) goes the text actor's way through the composite's decoder (its gated
    DeltaNet layers routed), equal to each row alone through the composite."""
    from zorro_core.verify.reference import loss_of, token_weights
    from zorro_core.verify.vision_reference import vision_per_sequence

    mm = long_batch()
    text_row = next(i for i, r in enumerate(mm.images) if not r)
    ps, rs = mm.batch.to_lists()
    batch = RolloutBatch.from_lists([ps[text_row]] * 3, [rs[text_row] + [7] * k for k in (0, 1, 70)])
    model = _model(family)
    w = token_weights(batch)
    with exact_delta_rule(model):
        out = VisionLanguageActor(model=model)(batch, calculate_entropy=True)
        loss_of(out.log_probs, out.entropy, w).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        rlp, rent, rgrads = vision_per_sequence(model, MultimodalBatch(batch, ((),) * 3), weights=w)
    assert out.plan.num_groups == 1
    assert (out.log_probs.detach() - rlp).abs().max().item() < LOGPROB_ATOL
    assert (out.entropy.detach() - rent).abs().max().item() < LOGPROB_ATOL
    g_err, g_name = max_rel_grad_error(grads, rgrads)
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e} relative"


@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 8, 12)])
def test_qwen3_5_vision_flops_are_the_towers_own_count(grid):
    """The tower's cost in the ideal (zorro_core.models.vision.vision_flops) against torch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from zorro_core.models.vision import vision_flops

    model = build_vision_model(tiny_config("qwen3_5"), attn_implementation="eager")
    n = grid[0] * grid[1] * grid[2]
    with FlopCounterMode(display=False) as counter:
        model.model.get_image_features(torch.randn(n, 24), torch.tensor([grid]))
    assert vision_flops(model.model.visual, grid) == counter.get_total_flops()
