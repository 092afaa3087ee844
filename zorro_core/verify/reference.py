"""The independent reference: each sequence run alone through the unmodified model.

No zorro code is involved: the model's own forward on one [prompt + response] row, no mask,
no position ids, log-softmax by hand. Every equivalence check (tests, `zorro verify`) compares
against this.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zorro_core.verify.delta_rule import device_delta_rule


def token_weights(batch, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights that differ between responses, so each pulls the prompt its own way."""
    g = torch.Generator().manual_seed(seed)
    shape = batch.responses.shape
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def loss_of(log_probs, entropy, weights) -> torch.Tensor:
    """sum(w_lp * log_probs) + sum(w_ent * entropy): a loss whose gradient reaches every token."""
    w_lp, w_ent = (w.to(log_probs.device, log_probs.dtype) for w in weights)
    loss = (w_lp * log_probs).sum()
    if entropy is not None:
        loss = loss + (w_ent * entropy).sum()
    return loss


def _sequence(model: nn.Module, prompt: list[int], response: list[int], temperature: float, device, router=False):
    ids = torch.tensor([prompt + response], device=device)
    kwargs = {"output_router_logits": True} if router else {}
    with device_delta_rule(model):  # transformers' kernel choice, made by the device (fla on CPU)
        out = model(input_ids=ids, use_cache=False, **kwargs)
    logits = out.logits[0, len(prompt) - 1 : len(prompt) - 1 + len(response)]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(acc) / temperature, dim=-1)
    lp = logp.gather(-1, torch.tensor(response, device=device)[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return (lp, ent, out.router_logits) if router else (lp, ent)


def sequence_forward(model: nn.Module, batch, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable [B, R] log-probs and entropy, one sequence at a time (0 at padding)."""
    prompts, responses = batch.to_lists()
    b, r = batch.responses.shape
    lps, ents = [], []
    for p, resp in zip(prompts, responses):
        lp, ent = _sequence(model, p, resp, temperature, batch.device)
        pad = r - len(resp)
        lps.append(torch.nn.functional.pad(lp, (0, pad)))
        ents.append(torch.nn.functional.pad(ent, (0, pad)))
    return torch.stack(lps), torch.stack(ents)


def per_sequence(model: nn.Module, batch, temperature: float = 1.0, weights=None, entropy: bool = True):
    """log-probs [B,R], entropy [B,R] and {param: grad} of loss_of(...), one sequence at a time.

    Each sequence is backpropagated on its own (gradients accumulate), so memory stays that of
    one sequence.
    """
    prompts, responses = batch.to_lists()
    b, r = batch.responses.shape
    dtype = next(model.parameters()).dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    lp_out = torch.zeros(b, r, dtype=acc)
    ent_out = torch.zeros(b, r, dtype=acc)
    model.zero_grad(set_to_none=True)
    for i, (p, resp) in enumerate(zip(prompts, responses)):
        lp, ent = _sequence(model, p, resp, temperature, batch.device)
        if weights is not None:
            w_lp, w_ent = weights
            loss = (w_lp[i, : len(resp)].to(lp) * lp).sum()
            if entropy:
                loss = loss + (w_ent[i, : len(resp)].to(ent) * ent).sum()
            loss.backward()
        lp_out[i, : len(resp)] = lp.detach().cpu()
        ent_out[i, : len(resp)] = ent.detach().cpu()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp_out, ent_out, grads


def per_sequence_aux(model: nn.Module, batch, temperature: float, weights, parts, aux_coef: float):
    """per_sequence's three results, for a loss that adds `aux_coef` times each part's (a micro-batch's
    rows) MoE router aux loss, as the plain computation of those rows gives it (transformers'
    load_balancing_loss_func over every token of every row; zorro_core.models.moe.load_balancing_loss
    computes the same, in float64); plus each part's aux loss. The whole loss is backpropagated at
    once (the aux loss couples the rows): small batches only."""
    from zorro_core.models.moe import load_balancing_loss

    prompts, responses = batch.to_lists()
    b, r = batch.responses.shape
    acc = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    lp_out, ent_out = torch.zeros(b, r, dtype=acc), torch.zeros(b, r, dtype=acc)
    model.zero_grad(set_to_none=True)
    loss: torch.Tensor = torch.zeros((), dtype=acc, device=batch.device)
    routers = []
    for i, (p, resp) in enumerate(zip(prompts, responses)):
        lp, ent, router = _sequence(model, p, resp, temperature, batch.device, router=True)
        loss = loss + (weights[0][i, : len(resp)].to(lp) * lp).sum() + (weights[1][i, : len(resp)].to(ent) * ent).sum()
        lp_out[i, : len(resp)], ent_out[i, : len(resp)] = lp.detach().cpu(), ent.detach().cpu()
        routers.append(router)
    cfg: Any = model.config
    auxes = []
    for part in parts:
        layers = [torch.cat([routers[row][layer] for row in part]) for layer in range(len(routers[0]))]
        auxes.append(load_balancing_loss(layers, cfg.num_experts, cfg.num_experts_per_tok))
        loss = loss + aux_coef * auxes[-1]
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp_out, ent_out, grads, [float(a.detach()) for a in auxes]


def actor_run(actor, batch, temperature: float = 1.0, weights=None, entropy: bool = True):
    """The same three results from a zorro actor, plus its ActorOutput."""
    actor.model.zero_grad(set_to_none=True)
    out = actor.forward(batch, temperature=temperature, calculate_entropy=entropy)
    if weights is not None:
        loss_of(out.log_probs, out.entropy, weights).backward()
    grads = {n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.model.zero_grad(set_to_none=True)
    ent = out.entropy.detach().cpu() if out.entropy is not None else None
    return out.log_probs.detach().cpu(), ent, grads, out


def rel_grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """||g - g_ref|| / ||g_ref|| of every parameter (absolute error where g_ref is exactly 0)."""
    if set(grads) != set(ref):
        missing = sorted(set(ref) ^ set(grads))
        raise AssertionError(f"gradients exist for different parameters: {missing[:5]}")
    out = {}
    for n, g_ref in ref.items():
        g_ref = g_ref.detach().double().cpu()
        denom = g_ref.norm().item()
        err = (grads[n].detach().double().cpu() - g_ref).norm().item()
        out[n] = err / denom if denom > 0 else err
    return out


def max_rel_grad_error(grads: dict, ref: dict) -> tuple[float, str]:
    """Worst ||g - g_ref|| / ||g_ref|| over parameters, and which parameter."""
    errs = rel_grad_errors(grads, ref)
    name = max(errs, key=lambda p: errs[p], default="")
    return (errs[name] if name else 0.0), name


def max_abs_error(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    """max |a - b| in float64 (0 for empty tensors, nan when one side is missing)."""
    if a is None or b is None:
        return float("nan")
    if a.numel() == 0:
        return 0.0
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
