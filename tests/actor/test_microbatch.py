"""actor.forward_backward: gradients accumulated over micro-batches equal one full-batch pass."""

import pytest
import torch
from helpers import (  # float64 floor: packing differs, transformers' float32 norms do not
    GRAD_RTOL,
    LP_ATOL,
    mixed_batch,
)

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.verify.reference import max_rel_grad_error, token_weights


def token_mean_loss(batch, weights):
    """A token-mean loss over the FULL batch: per-micro-batch sums over one global count."""
    w_lp, w_ent = weights
    n = batch.response_mask.sum()

    def loss_fn(out, rows):
        return (
            (w_lp[rows].to(out.log_probs) * out.log_probs).sum() + (w_ent[rows].to(out.entropy) * out.entropy).sum()
        ) / n

    return loss_fn


def grads_of(model):
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return g


def check_micro_batches(actor, model, batch, budget):
    """Assert `actor.forward_backward` under `budget` gives one full-batch pass's log-probs, entropy,
    loss and every gradient; returns its result."""
    loss_fn = token_mean_loss(batch, token_weights(batch, seed=3))
    model.zero_grad(set_to_none=True)
    full = actor.forward(batch, temperature=0.7, calculate_entropy=True)
    full_loss = loss_fn(full, torch.arange(batch.batch_size))
    full_loss.backward()
    ref = grads_of(model)
    res = actor.forward_backward(
        batch, loss_fn, max_tokens_per_micro_batch=budget, temperature=0.7, calculate_entropy=True
    )
    got = grads_of(model)
    assert (res.log_probs - full.log_probs.detach()).abs().max().item() < LP_ATOL
    assert (res.entropy - full.entropy.detach()).abs().max().item() < LP_ATOL
    assert abs(res.loss - full_loss.item()) < LP_ATOL
    err, name = max_rel_grad_error(got, ref)
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"
    return res


# Budget 12 splits the 17-token group (prompt 7 + responses 4, 5, 1) in two; 1 puts every row
# alone (each over budget); None is one micro-batch.
@pytest.mark.parametrize("budget", [None, 12, 20, 1])
@pytest.mark.parametrize("actor_kind", ["dedup", "dedup-memory", "dedup-prefix", "baseline-padded"])
def test_micro_batches_equal_full_batch(tiny_models, budget, actor_kind):
    model = tiny_models("tiny-qwen3")
    actor = {
        "dedup": lambda: DeduplicatedActor(model=model),
        "dedup-memory": lambda: DeduplicatedActor(model=model, logits_mode="memory", logits_chunk_size=3),
        "dedup-prefix": lambda: DeduplicatedActor(model=model, sharing="prefix", min_shared_tokens=1),
        "baseline-padded": lambda: BaselineActor(model=model, padded=True),
    }[actor_kind]()
    batch = mixed_batch()
    res = check_micro_batches(actor, model, batch, budget)
    parts = res.partition
    if budget is None:
        assert len(parts.parts) == 1
    if budget == 12 and actor_kind in ("dedup", "dedup-memory"):
        assert parts.split_groups == [0] and parts.recomputed_prompt_tokens == 7 and max(parts.tokens) <= 12
    if budget == 12 and actor_kind == "dedup-prefix":  # cut along the trie (29 tokens): see test_trie_microbatch
        assert parts.split_groups == [0] and max(parts.tokens) <= 12
        assert parts.recomputed_prompt_tokens == sum(parts.tokens) - 29
    if budget == 1:
        assert len(parts.parts) == batch.batch_size


def test_loss_fn_must_return_a_scalar(tiny_models):
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    with pytest.raises(ValueError, match="scalar"):
        actor.forward_backward(mixed_batch(), lambda out, rows: out.log_probs, max_tokens_per_micro_batch=12)
    actor.model.zero_grad(set_to_none=True)
