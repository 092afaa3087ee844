"""The prompt-once schedule's trainer hooks (what verl's engine drives): the log-prob pass
`prompt_once_logprobs`, `on_prompts_backward`, and `ActorConfig.schedule` as forward_backward's
default. Exact against the float64 per-sequence reference, with every boundary cutting a group."""

import torch
from helpers import GRAD_RTOL, LP_ATOL, mixed_batch
from test_schedule import CUT_EVERY_BOUNDARY, assert_exact, loss_fn_of

from zorro_core import ActorConfig, DeduplicatedActor
from zorro_core.actor.schedule import ScheduleOutput, prompt_once_logprobs, prompt_once_step
from zorro_core.verify.reference import max_rel_grad_error


def test_log_prob_pass_equals_reference_and_leaves_no_gradient(tiny_models, per_sequence_reference):
    model = tiny_models("tiny-qwen3")
    batch, _, (ref_lp, ref_ent, _) = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    model.zero_grad(set_to_none=True)
    res = prompt_once_logprobs(DeduplicatedActor(model=model), batch, None, 0.7, True, parts=CUT_EVERY_BOUNDARY)
    assert (res.log_probs - ref_lp).abs().max().item() < LP_ATOL
    assert (res.entropy - ref_ent).abs().max().item() < LP_ATOL
    assert not res.log_probs.requires_grad and res.loss == 0.0
    assert all(p.grad is None for p in model.parameters())
    assert res.split_groups == [0, 1] and res.prompt_tokens == 14 and res.kept_bytes > 0
    with torch.no_grad():  # a trainer's log-prob pass runs under no_grad
        again = prompt_once_logprobs(DeduplicatedActor(model=model), batch, 6, 0.7, False)
    assert (again.log_probs - ref_lp).abs().max().item() < LP_ATOL and again.entropy is None


def test_on_prompts_backward_runs_once_between_phase_2_and_phase_3(tiny_models, per_sequence_reference):
    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    events = []
    inner = loss_fn_of(w)

    def loss_fn(out, rows):
        events.append("loss")
        return inner(out, rows)

    # the prompts' first layer gets its key/value projections' gradient from phase 3 only if it ran
    k_proj = model.model.layers[0].self_attn.k_proj.weight

    def hook():
        events.append(("hook", None if k_proj.grad is None else k_proj.grad.clone()))

    model.zero_grad(set_to_none=True)
    res = prompt_once_step(
        DeduplicatedActor(model=model),
        batch,
        loss_fn,
        None,
        0.7,
        True,
        parts=CUT_EVERY_BOUNDARY,
        on_prompts_backward=hook,
    )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert [e if isinstance(e, str) else e[0] for e in events] == ["loss"] * 4 + ["hook"]
    before = events[-1][1]
    assert before is not None and not torch.allclose(before, grads["model.layers.0.self_attn.k_proj.weight"])
    assert_exact(res, grads, ref)


def test_actor_config_schedule_is_forward_backwards_default(tiny_models):
    model = tiny_models("tiny-qwen2")
    batch = mixed_batch()
    n = batch.response_mask.sum()
    w = torch.randn(batch.responses.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def loss_fn(out, rows):
        return (w[rows] * out.log_probs).sum() / n

    out = {}
    for config in (ActorConfig(), ActorConfig(schedule="prompt_once")):
        model.zero_grad(set_to_none=True)
        res = DeduplicatedActor(model=model, config=config).forward_backward(batch, loss_fn, 5)
        out[config.schedule] = (res, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    (a, ga), (b, gb) = out["micro_batch"], out["prompt_once"]
    assert isinstance(b, ScheduleOutput) and not isinstance(a, ScheduleOutput)
    assert (a.log_probs - b.log_probs).abs().max().item() < LP_ATOL
    err, name = max_rel_grad_error(gb, ga)
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"
    # an explicit schedule= still wins over the config's
    model.zero_grad(set_to_none=True)
    res = DeduplicatedActor(model=model, schedule="prompt_once").forward_backward(
        batch, loss_fn, 5, schedule="micro_batch"
    )
    model.zero_grad(set_to_none=True)
    assert not isinstance(res, ScheduleOutput)
