"""The independent reference: each sequence run alone through the unmodified model.

No zorro code is involved: the model's own forward on one [prompt + response] row, no mask,
no position ids, log-softmax by hand. Used by every equivalence test.
"""

from __future__ import annotations

import torch


def token_weights(batch, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss weights that differ between responses, so each pulls the prompt its own way."""
    g = torch.Generator().manual_seed(seed)
    shape = batch.responses.shape
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def loss_of(log_probs, entropy, weights) -> torch.Tensor:
    w_lp, w_ent = (w.to(log_probs.device, log_probs.dtype) for w in weights)
    loss = (w_lp * log_probs).sum()
    if entropy is not None:
        loss = loss + (w_ent * entropy).sum()
    return loss


def per_sequence(model, batch, temperature: float = 1.0, weights=None, entropy: bool = True):
    """log-probs [B,R], entropy [B,R] and {param: grad} of loss_of(...) computed one sequence at a time."""
    prompts, responses = batch.to_lists()
    b, r = batch.responses.shape
    dtype = next(model.parameters()).dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    lp_out = torch.zeros(b, r, dtype=acc)
    ent_out = torch.zeros(b, r, dtype=acc)
    model.zero_grad(set_to_none=True)
    for i, (p, resp) in enumerate(zip(prompts, responses)):
        ids = torch.tensor([p + resp], device=batch.device)
        logits = model(input_ids=ids, use_cache=False).logits[0, len(p) - 1 : len(p) - 1 + len(resp)]
        logp = torch.log_softmax(logits.to(acc) / temperature, dim=-1)
        lp = logp.gather(-1, torch.tensor(resp, device=ids.device)[:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
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


def actor_run(actor, batch, temperature: float = 1.0, weights=None, entropy: bool = True):
    """The same three results from a zorro actor."""
    actor.model.zero_grad(set_to_none=True)
    out = actor.forward(batch, temperature=temperature, calculate_entropy=entropy)
    if weights is not None:
        loss_of(out.log_probs, out.entropy, weights).backward()
    grads = {n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.model.zero_grad(set_to_none=True)
    ent = out.entropy.detach().cpu() if out.entropy is not None else None
    return out.log_probs.detach().cpu(), ent, grads, out


def max_rel_grad_error(grads, ref) -> tuple[float, str]:
    """Worst ||g - g_ref|| / ||g_ref|| over parameters, and which parameter."""
    if set(grads) != set(ref):
        missing = sorted(set(ref) ^ set(grads))
        raise AssertionError(f"gradients exist for different parameters: {missing[:5]}")
    worst, name = 0.0, ""
    for n, g_ref in ref.items():
        denom = g_ref.double().norm().item()
        err = (grads[n].double() - g_ref.double()).norm().item() / max(denom, 1e-30)
        if err > worst:
            worst, name = err, n
    return worst, name
