"""Qwen3-MoE (and the MoE blocks of Qwen3-Next and Qwen3.5-MoE) against the per-sequence float64 reference, and the
router load-balancing (aux) loss: with multiplicity weights (the default) it equals the baseline's;
with router_aux_weighting="unique" it is the loss of the deduplicated token set (each shared
prompt token once), which is what the test expects it to differ by."""

import pytest
import torch
from fla_devices import exact_kernels
from helpers import ACTOR_BATCHES, GRAD_RTOL, MODES, check, mixed_batch
from versions import QWEN3_NEXT_ADAPTABLE, QWEN3_NEXT_REASON

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.models.moe import load_balancing_loss
from zorro_core.plan.build import build_dedup_plan
from zorro_core.verify.reference import max_rel_grad_error

BATCHES = ACTOR_BATCHES
AUX_RTOL = 1e-7  # measured 1.7e-10 relative in float64 (router softmax runs in float32 upstream)


def moe(tiny_models, family="tiny-qwen3-moe"):
    return tiny_models(family, output_router_logits=True)


@pytest.fixture(scope="module")
def references(tiny_models, per_sequence_reference):
    def get(batch_name):
        return per_sequence_reference(batch_name, lambda: moe(tiny_models), BATCHES[batch_name], 0.8, seed=1)

    return get


@pytest.mark.parametrize("split,attn", MODES)
@pytest.mark.parametrize("batch_name", list(BATCHES))
def test_moe_dedup_matches_per_sequence(tiny_models, references, split, attn, batch_name):
    batch, w, ref = references(batch_name)
    out = check(
        DeduplicatedActor(model=moe(tiny_models), use_split_attention=split, attn_implementation=attn),
        batch,
        w,
        ref,
        0.8,
    )
    assert out.aux_loss is not None and out.plan.num_groups < batch.batch_size


@pytest.mark.parametrize("padded", [False, True])
def test_moe_baseline_matches_per_sequence(tiny_models, references, padded):
    batch, w, ref = references("mixed")
    check(BaselineActor(model=moe(tiny_models), padded=padded, attn_implementation="eager"), batch, w, ref, 0.8)


def per_sequence_router_logits(model, batch, drop_repeated_prompts: bool = False):
    """Each layer's router logits of every sequence run alone, concatenated (optionally without the
    prompt tokens of a row whose prompt appeared in an earlier row)."""
    prompts, responses = batch.to_lists()
    layers, seen = None, set()
    for p, r in zip(prompts, responses):
        out = model.model(input_ids=torch.tensor([p + r]), use_cache=False, output_router_logits=True)
        skip = len(p) if drop_repeated_prompts and tuple(p) in seen else 0
        seen.add(tuple(p))
        layers = layers or [[] for _ in out.router_logits]
        for acc, logits in zip(layers, out.router_logits):
            acc.append(logits[skip:])
    return tuple(torch.cat(x) for x in layers)


def aux_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize(
    "family",
    [
        "tiny-qwen3-moe",
        pytest.param("tiny-qwen3-next", marks=pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON)),
        # shared expert beside the routed ones; the router always renormalises its top-k
        pytest.param("tiny-qwen3.5-moe", marks=pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON)),
    ],
)
@pytest.mark.parametrize("batch_name", ["mixed", "dummy_padded"])
def test_aux_loss_with_multiplicity_equals_baseline(tiny_models, family, batch_name, monkeypatch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    # The float64 delta rule (route-less reference forwards and actors alike, fla installed or not): the
    # gradient of a later layer's router reaches A_log through the kernel, which transformers' runs in
    # float32 (measured 3.5e-5 relative on tiny-qwen3.5-moe's A_log with it).
    exact_kernels(monkeypatch)

    model = moe(tiny_models, family)
    cfg = model.config
    batch = BATCHES[batch_name]()
    ref_logits = per_sequence_router_logits(model, batch)
    ref = load_balancing_loss(ref_logits, cfg.num_experts, cfg.num_experts_per_tok)
    ref_grads = aux_grads(model, ref)
    hf = load_balancing_loss_func(tuple(x.detach() for x in ref_logits), cfg.num_experts, cfg.num_experts_per_tok)
    assert abs(hf.item() - ref.item()) < 1e-6 * ref.item()  # transformers' own (float32) loss: the same quantity
    actors = [DeduplicatedActor(model=model), BaselineActor(model=model)]
    if family == "tiny-qwen3-moe":  # the padded baseline refuses linear-attention models
        actors.append(BaselineActor(model=model, padded=True, attn_implementation="eager"))
    for actor in actors:
        aux = actor.forward(batch).aux_loss
        assert aux.dtype == torch.float64
        assert abs(aux.item() - ref.item()) < AUX_RTOL * ref.item(), (type(actor).__name__, aux.item(), ref.item())
        g_err, g_name = max_rel_grad_error(aux_grads(model, aux), ref_grads)
        assert g_err < GRAD_RTOL, f"aux-loss gradient of {g_name} off by {g_err:.2e}"


def test_aux_loss_unique_counts_shared_prompt_tokens_once(tiny_models):
    model = moe(tiny_models)
    cfg = model.config
    batch = mixed_batch()
    baseline = load_balancing_loss(per_sequence_router_logits(model, batch), cfg.num_experts, cfg.num_experts_per_tok)
    unique = load_balancing_loss(
        per_sequence_router_logits(model, batch, drop_repeated_prompts=True), cfg.num_experts, cfg.num_experts_per_tok
    )
    aux = DeduplicatedActor(model=model, router_aux_weighting="unique").forward(batch).aux_loss
    assert abs(aux.item() - unique.item()) < AUX_RTOL * unique.item()
    assert (
        abs(aux.item() - baseline.item()) > 1e3 * AUX_RTOL * baseline.item()
    )  # the documented difference is real here


def test_token_multiplicity():
    plan = build_dedup_plan(mixed_batch())
    m = plan.token_multiplicity()
    is_prompt = plan.token_segment < plan.num_groups
    assert m.sum().item() == plan.logical_tokens
    assert torch.equal(m[is_prompt], plan.group_size[plan.token_group[is_prompt]].double())
    assert torch.all(m[~is_prompt] == 1)


def test_aux_loss_off_unless_router_logits_requested(tiny_models):
    assert DeduplicatedActor(model=tiny_models("tiny-qwen3-moe")).forward(mixed_batch()).aux_loss is None
    with pytest.raises(ValueError, match="router_aux_weighting"):
        DeduplicatedActor(model=tiny_models("tiny-qwen3-moe"), router_aux_weighting="tokens")
