"""Mixture-of-experts (Qwen3-MoE, Qwen3-Next, DeepSeek-V3, GLM-4-MoE): token-wise, so dedup just works.

Routing and experts act on one token at a time, so a prompt token computed once gets the same
experts and the same output as each of its N copies in the baseline. What changes is the
router's load-balancing (aux) loss, a statistic over the batch's tokens: the packed row holds a
shared prompt token once where the baseline holds it N times.

`router_aux_weighting` chooses how the actor counts tokens in that loss:
- "multiplicity" (the default): each packed token is weighted by how many batch rows contain
  it (its group's size for a prompt token, 1 for a response token), so the loss equals the
  baseline's (transformers' `load_balancing_loss_func` over every real token of the batch).
- "unique": each packed token counts once, i.e. the loss of the deduplicated token set. It
  differs from the baseline's whenever a prompt is shared (prompts weigh less against responses).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from zorro_core.plan.protocol import Plan

AUX_WEIGHTINGS = ("multiplicity", "unique")


def routed_experts(config) -> int:
    """Routed experts per MoE layer (0 for a dense model): Qwen's `num_experts`, DeepSeek's and
    GLM-4-MoE's `n_routed_experts`."""
    return int(getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 0)


def is_moe(config) -> bool:
    """Whether the model has the Qwen-style (softmax router, Switch aux loss) MoE blocks whose aux
    loss zorro weights. Keyed on `num_experts`: DeepSeek-V3 / GLM-4-MoE (`n_routed_experts`, sigmoid
    router) compute no aux loss in transformers, and their families say so (router_aux_loss=False)."""
    return bool(getattr(config, "num_experts", 0)) and hasattr(config, "num_experts_per_tok")


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Switch-Transformer aux loss of transformers' MoE models, with per-token weights.

    Same formula as transformers' `load_balancing_loss_func` with a 2D attention mask (a 0/1 mask
    is a weight vector): E * sum_e f_e * P_e over all layers' tokens, where f_e is the weighted share
    of top-k assignments to expert e and P_e its weighted mean router probability. Accumulates in
    float64 for float64 logits (transformers accumulates in float32).
    """
    if not router_logits:
        raise ValueError("no router logits: the model has no MoE layer")
    first = router_logits[0]
    acc = torch.float64 if first.dtype == torch.float64 else torch.float32
    w = torch.ones(first.shape[0], dtype=acc, device=first.device) if weights is None else weights.to(first.device, acc)
    if w.shape != (first.shape[0],):
        raise ValueError(f"weights must have shape [{first.shape[0]}], got {tuple(w.shape)}")
    count = torch.zeros(num_experts, dtype=acc, device=first.device)
    prob = torch.zeros(num_experts, dtype=acc, device=first.device)
    for logits in router_logits:
        p = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(p, top_k, dim=-1)
        count = count.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob = prob + (p.to(acc) * w[:, None]).sum(0)
    total = w.sum() * len(router_logits)
    return num_experts * torch.sum((count / total) * (prob / total))


def router_aux_loss(router_logits: Sequence[torch.Tensor], config, plan: Plan, weighting: str) -> torch.Tensor:
    """The batch's router aux loss from the packed row's router logits, counted the `weighting` way."""
    if weighting not in AUX_WEIGHTINGS:
        raise ValueError(f"unknown router_aux_weighting {weighting!r}; choose one of {AUX_WEIGHTINGS}")
    weights = plan.token_multiplicity() if weighting == "multiplicity" else None
    return load_balancing_loss(router_logits, config.num_experts, config.num_experts_per_tok, weights)
