"""Log-probs (and entropy) of response tokens from final hidden states.

Modes:
- `none`:    lm_head over every position, then gather the ones that predict a response token.
- `compute`: lm_head only at those positions.
- `memory`:  `compute`, chunked over positions, each chunk recomputed in backward, so at most
             one chunk's [positions, vocab] logits exist at any time.
Softmax runs in float32 (float64 when the model is float64); temperature divides the logits.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

LOGITS_MODES = ("none", "compute", "memory")


def _lp_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logp = torch.log_softmax(logits.to(acc) / temperature, dim=-1)
    lp = logp.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, ent


def _chunk(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, temperature: float, with_entropy: bool):
    lp, ent = _lp_entropy(lm_head(hidden), labels, temperature, with_entropy)
    return (lp, ent) if with_entropy else (lp,)


def chunk_size_for_budget(vocab_size: int, budget_mib: float, bytes_per_value: int = 4) -> int:
    """Positions per chunk so that a chunk's logits, log-probs and their grads fit the budget."""
    per_position = vocab_size * bytes_per_value * 4
    return max(1, int(budget_mib * 2**20 // per_position))


def response_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    index: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    mode: str = "compute",
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of labels[i] predicted at hidden[index[i]]; hidden is [T, H]. Returns ([N], [N] or None)."""
    if mode not in LOGITS_MODES:
        raise ValueError(f"unknown logits_mode {mode!r}; choose one of {LOGITS_MODES}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if mode == "none":
        logits = lm_head(hidden)[index]
        return _lp_entropy(logits, labels, temperature, calculate_entropy)
    h = hidden[index]
    if mode == "compute":
        return _lp_entropy(lm_head(h), labels, temperature, calculate_entropy)
    size = chunk_size or chunk_size_for_budget(lm_head.out_features, 256.0)
    lps, ents = [], []
    for start in range(0, h.shape[0], size):
        sl = slice(start, start + size)
        if torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in lm_head.parameters())):
            res = checkpoint(_chunk, h[sl], lm_head, labels[sl], temperature, calculate_entropy, use_reentrant=False)
        else:
            res = _chunk(h[sl], lm_head, labels[sl], temperature, calculate_entropy)
        lps.append(res[0])
        if calculate_entropy:
            ents.append(res[1])
    lp = torch.cat(lps) if lps else h.new_zeros(0)
    ent = (torch.cat(ents) if ents else h.new_zeros(0)) if calculate_entropy else None
    return lp, ent
