"""The prompt-once schedule: each prompt once per step, exact against the per-sequence float64 reference
with groups cut at every micro-batch boundary; what it does not serve is refused with the reason."""

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, mixed_batch

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.actor.schedule import Groups, prompt_once_step, response_micro_batches
from zorro_core.errors import UnsupportedModelError
from zorro_core.stack.checkpointing import checkpointed
from zorro_core.verify.reference import max_rel_grad_error

# mixed_batch's groups: a = rows 0, 3, 5; c = rows 1, 4; b = row 2. Every boundary of these parts
# falls inside a group (0|3 and 3|5 cut a, 1|4 cuts c), so every part but the first reuses kept keys.
CUT_EVERY_BOUNDARY = [[0], [3], [5, 1], [4, 2]]


def loss_fn_of(weights):
    w_lp, w_ent = weights

    def loss_fn(out, rows):  # a sum: the full step's constants (here 1) scale it
        return (w_lp[rows].to(out.log_probs) * out.log_probs).sum() + (w_ent[rows].to(out.entropy) * out.entropy).sum()

    return loss_fn


def run_schedule(model, batch, weights, flavour=None, parts=CUT_EVERY_BOUNDARY, budget=None):
    actor = DeduplicatedActor(model=model)
    model.zero_grad(set_to_none=True)
    with checkpointed(model, flavour):
        res = prompt_once_step(
            actor, batch, loss_fn_of(weights), budget, temperature=0.7, calculate_entropy=True, parts=parts
        )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return res, grads


def assert_exact(res, grads, ref):
    ref_lp, ref_ent, ref_grads = ref
    assert (res.log_probs - ref_lp).abs().max().item() < LP_ATOL
    assert (res.entropy - ref_ent).abs().max().item() < LP_ATOL
    err, name = max_rel_grad_error(grads, ref_grads)
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


FAMILIES = [
    "tiny-qwen3",  # dense, GQA, q/k norms
    "tiny-llama",
    "tiny-qwen2-sliding",  # a sliding window (5) shorter than a prompt (7)
    "tiny-gemma3",  # sliding and full layers, two rotaries
    "tiny-olmo3",
    "tiny-deepseek-v3",  # MLA (qk 24, v 12), MoE without an aux loss
    "tiny-qwen3-moe",
]


@pytest.mark.parametrize("name", FAMILIES)
def test_exact_with_every_boundary_cutting_a_group(tiny_models, per_sequence_reference, name):
    model = tiny_models(name)
    batch, w, ref = per_sequence_reference(name, lambda: model, mixed_batch, 0.7, 3)
    res, grads = run_schedule(model, batch, w)
    assert res.split_groups == [0, 1] and res.prompt_tokens == 7 + 4 + 3
    assert res.response_tokens == [4, 5, 1 + 2, 6 + 1]  # no prompt token in any micro-batch
    assert_exact(res, grads, ref)


@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])
def test_exact_under_checkpointing(tiny_models, per_sequence_reference, name, flavour):
    model = tiny_models(name)
    batch, w, ref = per_sequence_reference(name, lambda: model, mixed_batch, 0.7, 3)
    res, grads = run_schedule(model, batch, w, flavour)
    assert_exact(res, grads, ref)


def test_budget_cuts_in_response_tokens(tiny_models, per_sequence_reference):
    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    res, grads = run_schedule(model, batch, w, parts=None, budget=6)
    assert all(t <= 6 for t in res.response_tokens)
    assert sum(res.response_tokens) == int(batch.response_mask.sum())
    assert res.prompt_tokens == 14 and res.split_groups  # the budget splits group a, its prompt still once
    assert_exact(res, grads, ref)


def test_forward_backward_option_matches_micro_batch_schedule(tiny_models):
    """actor.forward_backward(schedule="prompt_once") equals today's schedule under one budget:
    the same log-probs, loss and gradients (a token-mean over the full batch)."""
    model = tiny_models("tiny-qwen2")
    actor = DeduplicatedActor(model=model)
    batch = mixed_batch()
    n = batch.response_mask.sum()
    w = torch.randn(batch.responses.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss_fn(out, rows):
        return (w[rows] * out.log_probs).sum() / n

    out = {}
    for schedule in ("micro_batch", "prompt_once"):
        model.zero_grad(set_to_none=True)
        res = actor.forward_backward(batch, loss_fn, max_tokens_per_micro_batch=5, schedule=schedule)
        out[schedule] = (res, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    (a, ga), (b, gb) = out["micro_batch"], out["prompt_once"]
    assert (a.log_probs - b.log_probs).abs().max().item() < LP_ATOL
    assert abs(a.loss - b.loss) < LP_ATOL
    err, name = max_rel_grad_error(gb, ga)
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


def test_response_micro_batches_keep_group_order_and_budget():
    groups = Groups([[1, 2], [3]], group_of_row=[0, 1, 0, 1, 0], response_lens=[3, 2, 4, 1, 2])
    assert response_micro_batches(groups, None) == [[0, 2, 4, 1, 3]]
    assert response_micro_batches(groups, 5) == [[0], [2], [4, 1, 3]]
    assert response_micro_batches(groups, 1) == [[0], [2], [4], [1], [3]]  # a row over budget runs alone


def test_refusals(tiny_models):
    model = tiny_models("tiny-qwen3")
    batch = mixed_batch()

    def loss(out, rows):
        return out.log_probs.sum()

    with pytest.raises(UnsupportedModelError, match="deduplicated actor"):
        BaselineActor(model=model).forward_backward(batch, loss, schedule="prompt_once")
    actor = DeduplicatedActor(model=model)
    with pytest.raises(ValueError, match="unknown schedule"):
        actor.forward_backward(batch, loss, schedule="prompt-once")
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        actor.forward_backward(batch, loss, max_tokens_per_micro_batch=0, schedule="prompt_once")
    with pytest.raises(ValueError, match="every row"):
        prompt_once_step(actor, batch, loss, parts=[[0, 1], [2]])
    assert model.zero_grad(set_to_none=True) is None and all(p.grad is None for p in model.parameters())


def test_a_dropped_key_gradient_is_caught(tiny_models, per_sequence_reference, monkeypatch):
    """The comparison has teeth: phase 3 without the kept keys' and values' gradients is off by far
    more than the tolerance (the prompts' k/v projections miss every response's pull)."""
    from zorro_core.attention import external

    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    monkeypatch.setattr(external.InjectGrad, "backward", staticmethod(lambda ctx, dout: (dout, None, None, None, None)))
    res, grads = run_schedule(model, batch, w)
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL  # the forward is untouched
    err, _ = max_rel_grad_error(grads, ref[2])
    assert err > 1e-2


@pytest.mark.parametrize("logits", [dict(logits_mode="none"), dict(logits_mode="memory", logits_chunk_size=3)])
def test_exact_in_every_logits_mode(tiny_models, per_sequence_reference, logits):
    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    actor = DeduplicatedActor(model=model, **logits)
    model.zero_grad(set_to_none=True)
    res = prompt_once_step(actor, batch, loss_fn_of(w), None, 0.7, True, parts=CUT_EVERY_BOUNDARY)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert_exact(res, grads, ref)


def test_a_failing_loss_leaves_no_gradient(tiny_models):
    model = tiny_models("tiny-qwen3")
    model.zero_grad(set_to_none=True)
    calls = []

    def loss(out, rows):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return out.log_probs.sum()

    with pytest.raises(RuntimeError, match="boom"):
        prompt_once_step(DeduplicatedActor(model=model), mixed_batch(), loss, parts=CUT_EVERY_BOUNDARY)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="loss_fn"):
        prompt_once_step(DeduplicatedActor(model=model), mixed_batch(), None)


def test_an_attention_module_run_twice_in_one_forward_is_refused():
    from torch import nn

    from zorro_core.attention.external import KeptPrefix, KeyRegion

    pos = torch.arange(3)
    kept = KeptPrefix(positions=pos, prompt_of=torch.zeros(3, dtype=torch.long))
    region = KeyRegion(kept, pos, kept.prompt_of, kept.prompt_of, capture=True)
    q = k = v = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    layer = nn.Identity()
    region.attend(layer, q, k, v, 0.5, None)
    with pytest.raises(UnsupportedModelError, match="ran twice in one forward"):
        region.attend(layer, q, k, v, 0.5, None)
    region.sealed = True  # after the forward: checkpointing's recompute, served with the first leaves
    region.attend(layer, q, k, v, 0.5, None)
    assert kept.keys[layer].requires_grad and kept.keys[layer].grad_fn is None


def test_the_schedule_is_self_checked(tiny_models, per_sequence_reference):
    """With the self-check on (CUDA's default; forced here), the schedule's first step checks its own
    path on a slice of the batch, records the verdict, and leaves the step's gradients exact."""
    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    actor = DeduplicatedActor(model=model, self_check=True)
    model.zero_grad(set_to_none=True)
    res = prompt_once_step(actor, batch, loss_fn_of(w), None, 0.7, True, parts=CUT_EVERY_BOUNDARY)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    (key, verdict), *_ = [(k, v) for k, v in actor.self_check.verdicts.items() if k[0] == "prompt_once"]
    assert verdict.passed and verdict.grad_error < 1e-6 and res.fallback is None, verdict.describe()
    assert actor.self_check.metric() == 1.0
    assert_exact(res, grads, ref)


def test_a_failing_self_check_falls_back_to_each_micro_batch_on_its_own(
    tiny_models, per_sequence_reference, monkeypatch
):
    """Planted bug in the schedule (the kept keys' and values' gradients dropped): its self-check fails,
    says so once, and the step runs each micro-batch through actor.forward instead: still exact."""
    from zorro_core.actor.self_check import SelfCheckWarning
    from zorro_core.attention import external

    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    monkeypatch.setattr(external.InjectGrad, "backward", staticmethod(lambda ctx, dout: (dout, None, None, None, None)))
    actor = DeduplicatedActor(model=model, self_check=True)
    model.zero_grad(set_to_none=True)
    with pytest.warns(SelfCheckWarning, match="prompt-once schedule"):
        res = prompt_once_step(actor, batch, loss_fn_of(w), None, 0.7, True, parts=CUT_EVERY_BOUNDARY)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert res.fallback and "self-check failed" in res.fallback and actor.self_check.metric() == 0.0
    assert res.prompt_tokens > 14  # each prompt once per micro-batch that holds its rows
    assert_exact(res, grads, ref)
