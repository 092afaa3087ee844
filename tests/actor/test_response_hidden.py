"""DeduplicatedActor.response_hidden (what a value head reads, e.g. OpenRLHF's critic) against each sequence run
alone through the unmodified base model in float64: the hidden state at the position predicting each response
token, and every gradient of a random weighting of it."""

import copy

import pytest
import torch

from zorro_core import DeduplicatedActor, create_dummy_batch
from zorro_core.verify.reference import max_rel_grad_error
from zorro_core.verify.tolerances import GRAD_RTOL, LOGPROB_ATOL


def per_row(model, batch, w):
    """Each row alone, unpadded: hidden at its last prompt token and its response tokens but the last."""
    base = model.model
    rows = []
    loss = 0
    for b in range(batch.prompts.shape[0]):
        p = batch.prompts[b][batch.prompt_mask[b].bool()]
        r = batch.responses[b][batch.response_mask[b].bool()]
        h = base(torch.cat([p, r])[None]).last_hidden_state[0]
        at = h[len(p) - 1 : len(p) - 1 + len(r)]  # position j predicts token j + 1
        rows.append(at)
        loss = loss + (at * w[b, : len(r), None]).sum()
    loss.backward()
    return rows, {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_response_hidden_equals_per_sequence(tiny_models, sharing):
    model = tiny_models("tiny-qwen3")
    batch = create_dummy_batch(batch_size=6, num_unique_prompts=2, prompt_len=9, response_len=5, vocab_size=256, seed=4)
    w = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref_model, ded_model = copy.deepcopy(model), copy.deepcopy(model)
    ref_rows, ref_grads = per_row(ref_model, batch, w)
    actor = DeduplicatedActor(model=ded_model, sharing=sharing)
    hidden, plan = actor.response_hidden(batch)
    assert hidden.shape == (int(batch.response_mask.sum()), model.config.hidden_size)
    assert plan.unique_prompt_tokens < plan.logical_prompt_tokens
    # [N, H] -> [B, R, H] through the plan, one hidden dimension at a time
    placed = torch.stack([plan.scatter_responses(hidden[:, k]) for k in range(hidden.shape[1])], -1)
    (placed * w[..., None]).sum().backward()
    grads = {n: q.grad.clone() for n, q in ded_model.named_parameters() if q.grad is not None}
    for b, rows in enumerate(ref_rows):
        err = (placed[b, : len(rows)] - rows).abs().max().item()
        assert err <= LOGPROB_ATOL, f"row {b}: hidden off by {err:.2e}"
    assert "lm_head.weight" not in grads  # no lm_head runs
    g_err, name = max_rel_grad_error(grads, {n: g for n, g in ref_grads.items() if n in grads})
    assert set(grads) == set(ref_grads) and g_err <= GRAD_RTOL, (name, g_err)
