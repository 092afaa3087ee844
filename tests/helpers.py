"""Helpers several test files share: the float64 tolerances, the mixed batch, the comparison.

Plain functions live here (test files import them); fixtures live in conftest.py.
"""

import contextlib
from typing import Iterator

import pytest
import torch
from versions import QWEN3_NEXT_ADAPTABLE, QWEN3_NEXT_REASON

from zorro_core import RolloutBatch, create_dummy_batch
from zorro_core.actor.schedule import prompt_once_step
from zorro_core.models.linear_attention import LINEAR_LAYER_TYPES
from zorro_core.models.moe import load_balancing_loss
from zorro_core.models.presets import PRESETS
from zorro_core.models.registry import FAMILIES
from zorro_core.stack.checkpointing import checkpointed
from zorro_core.verify.reference import actor_run, max_rel_grad_error
from zorro_core.verify.tolerances import GRAD_RTOL
from zorro_core.verify.tolerances import LOGPROB_ATOL as LP_ATOL

# The float64 tolerances are zorro verify's (zorro_core.verify.tolerances). `check` compares
# strictly (error < tolerance) where verify's rule allows equality (<=): the same numbers.


def mixed_batch() -> RolloutBatch:
    """Groups of sizes 3, 1 and 2 with different prompt lengths, duplicates not adjacent,
    a response of length 1, and a prompt that is a strict prefix of another (23 response tokens)."""
    a = [5, 17, 33, 2, 9, 41, 7]
    b = [11, 3, 8]
    c = [5, 17, 33, 2]  # strict prefix of a: must not merge with it
    prompts = [a, c, b, a, c, a]
    responses = [[1, 4, 9, 16], [20, 21], [7], [3, 3, 3, 3, 3], [30, 31, 32, 33, 34, 35], [8]]
    return RolloutBatch.from_lists(prompts, responses)


# The actor's four attention routes: (use_split_attention, attn_implementation).
MODES = [(True, "eager"), (True, "sdpa"), (False, "eager"), (False, "sdpa")]


def check(actor, batch, w, ref, temperature):
    """Run `actor` and assert its log-probs, entropy and every gradient equal the reference `ref`."""
    lp, ent, grads, out = actor_run(actor, batch, temperature, w)
    ref_lp, ref_ent, ref_grads = ref
    assert lp.dtype == torch.float64
    assert torch.all(lp[~batch.response_mask.bool()] == 0)
    lp_err = (lp - ref_lp).abs().max().item()
    ent_err = (ent - ref_ent).abs().max().item()
    g_err, g_name = max_rel_grad_error(grads, ref_grads)
    assert lp_err < LP_ATOL, f"log-prob error {lp_err:.2e}"
    assert ent_err < LP_ATOL, f"entropy error {ent_err:.2e}"
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e} relative"
    return out


# Batches the actor tests run every mode on: the mixed batch, a padded and an unpadded dummy one.
ACTOR_BATCHES = {
    "mixed": mixed_batch,
    "dummy_padded": lambda: create_dummy_batch(
        batch_size=6, num_unique_prompts=2, prompt_len=12, response_len=6, vocab_size=256, vary_lengths=True, seed=3
    ),
    "dummy_unpadded": lambda: create_dummy_batch(
        batch_size=4, num_unique_prompts=1, prompt_len=9, response_len=5, vocab_size=256, seed=4
    ),
}


def _tiny_preset(name: str):
    """`name` as a test parameter: skipped, with the reason, where this transformers predates its adapter."""
    family = FAMILIES[PRESETS[name][0]]
    linear = any(t in LINEAR_LAYER_TYPES for t in family.layer_types)
    return pytest.param(name, marks=pytest.mark.skipif(linear and not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON))


# Every test shape of every family the registry serves (a family added there is tested here too).
TINY_PRESETS = [_tiny_preset(name) for name in PRESETS if name.startswith("tiny-")]


def rows_alone_reference(model, batch, weights, temperature, parts=None, aux_coef=None):
    """Each row alone through the unmodified model (float64 in the tests): log-probs, entropy, the
    gradient of sum(w * log-probs) + sum(w' * entropy) (+ aux_coef * each part's router aux loss over
    its rows' tokens, each row's prompt counted in full: the plain per-micro-batch computation's), and
    each part's aux loss."""
    prompts, responses = batch.to_lists()
    b, r = batch.responses.shape
    lp_out, ent_out = torch.zeros(b, r, dtype=torch.float64), torch.zeros(b, r, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    loss, routers = 0.0, []
    for i, (p, resp) in enumerate(zip(prompts, responses)):
        out = model(input_ids=torch.tensor([p + resp]), use_cache=False, output_router_logits=aux_coef is not None)
        logp = torch.log_softmax(out.logits[0, len(p) - 1 : len(p) - 1 + len(resp)] / temperature, -1)
        lp = logp.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        loss = loss + (weights[0][i, : len(resp)] * lp).sum() + (weights[1][i, : len(resp)] * ent).sum()
        lp_out[i, : len(resp)], ent_out[i, : len(resp)] = lp.detach(), ent.detach()
        routers.append(out.router_logits if aux_coef is not None else None)
    auxes = []
    if aux_coef is not None:
        cfg = model.config
        for part in parts:
            layers = [torch.cat([routers[row][layer] for row in part]) for layer in range(len(routers[0]))]
            auxes.append(load_balancing_loss(layers, cfg.num_experts, cfg.num_experts_per_tok))
            loss = loss + aux_coef * auxes[-1]
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp_out, ent_out, grads, [float(a.detach()) for a in auxes]


@contextlib.contextmanager
def counting_reduce_scatters() -> Iterator[list[int]]:
    """Within: each call of FSDP2's foreach_reduce (a parameter group's gradients in one
    reduce-scatter) appends to the list yielded."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    calls: list[int] = []
    real = _fsdp_param_group.foreach_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    _fsdp_param_group.foreach_reduce = counting
    try:
        yield calls
    finally:
        _fsdp_param_group.foreach_reduce = real


def prompt_once_run(
    actor, batch, weights, temperature, budget=None, flavour=None, parts=None, wave_tokens=None, aux_coef=None
):
    """One prompt_once_step of `actor` on the loss sum(w * log-probs) + sum(w' * entropy) (+ aux_coef *
    the router aux loss), under checkpointing `flavour`: its result and the parameters' gradients."""
    w_lp, w_ent = weights

    def loss_fn(out, rows):
        loss = (w_lp[rows] * out.log_probs).sum() + (w_ent[rows] * out.entropy).sum()
        return loss + aux_coef * out.aux_loss if aux_coef is not None else loss

    model = actor.model
    model.zero_grad(set_to_none=True)
    with checkpointed(model, flavour):
        res = prompt_once_step(
            actor,
            batch,
            loss_fn,
            budget,
            temperature,
            True,
            parts=parts,
            router_aux_loss=aux_coef is not None,
            wave_tokens=wave_tokens,
        )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return res, grads
