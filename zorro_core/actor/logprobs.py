"""Log-probs (and entropy) of response tokens from final hidden states.

Modes:
- `none`:    lm_head over every position, then gather the ones that predict a response token.
- `compute`: lm_head only at those positions.
- `memory`:  `compute`, chunked over positions by a custom autograd function: forward keeps
             only per-position results (log-prob, logsumexp, entropy), backward recomputes each
             chunk's logits and accumulates the gradients of the hidden states and of lm_head's
             weight (and bias). At most one chunk's [positions, vocab] temporaries exist at a time;
             the chunk size comes from a memory budget (`chunk_size_for_budget`).
Softmax runs in float32 (float64 when the model is float64); temperature divides the logits.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

LOGITS_MODES = ("none", "compute", "memory")
DEFAULT_LOGITS_MEMORY_BUDGET_MIB = 256.0
"""Budget for one chunk's temporaries in `memory` mode when the caller sets none."""


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _lp_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool):
    logp = torch.log_softmax(logits.to(_acc_dtype(logits.dtype)) / temperature, dim=-1)
    lp = logp.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, ent


MAX_CHUNK_POSITIONS = 2**62
"""The largest chunk size a budget gives (a budget past every batch: one chunk)."""


def chunk_size_for_budget(vocab_size: int, budget_mib: float, dtype: torch.dtype = torch.float32) -> int:
    """Positions per chunk so that one chunk's temporaries fit `budget_mib` MiB.

    Backward is the peak: per position it holds the logits in the model dtype, log-probs and
    probabilities in the softmax dtype (float32, or float64), and the logits' gradient in the
    model dtype. The budget does not cover the weight's gradient (as large as the weight, needed
    by every mode) nor the per-position outputs.
    """
    if not budget_mib > 0:
        raise ValueError(f"logits memory budget must be > 0 MiB, got {budget_mib}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    model_bytes = torch.empty((), dtype=dtype).element_size()
    acc_bytes = torch.empty((), dtype=_acc_dtype(dtype)).element_size()
    per_position = vocab_size * (2 * model_bytes + 2 * acc_bytes)
    # Divided first and capped: a huge finite budget (1e303 MiB) would overflow to inf in bytes.
    return max(1, int(min(budget_mib * (2**20 / per_position), MAX_CHUNK_POSITIONS)))


def _chunk_log_softmax(h, weight, bias, temperature, lse=None):
    """log_softmax(linear(h) / T) of one chunk in the softmax dtype, and its logsumexp."""
    z = F.linear(h, weight, bias)
    acc = _acc_dtype(z.dtype)
    x = z.to(acc) if z.dtype != acc else z
    x.div_(temperature)
    if lse is None:
        lse = torch.logsumexp(x, -1)
    return x.sub_(lse[:, None]), lse


class ChunkedLogProbs(torch.autograd.Function):
    """(hidden [N,H], weight [V,H], bias [V]|None, labels [N]) -> (log-prob [N], entropy [N] or [0]).

    Forward saves only the inputs and per-position statistics; backward recomputes each chunk's
    logits. Gradients: d lp / d x = onehot - p and d H / d x = -p (log p + H), x = logits / T.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature: float, chunk_size: int, with_entropy: bool):
        n = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        lp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n if with_entropy else 0, dtype=acc, device=hidden.device)
        for s in range(0, n, chunk_size):
            sl = slice(s, s + chunk_size)
            logp, lse[sl] = _chunk_log_softmax(hidden[sl], weight, bias, temperature)
            lp[sl] = logp.gather(-1, labels[sl, None]).squeeze(-1)
            if with_entropy:
                ent[sl] = -logp.exp().mul_(logp).sum(-1)
            del logp
        ctx.save_for_backward(hidden, weight, bias, labels, lse, ent)
        ctx.temperature, ctx.chunk_size, ctx.with_entropy = temperature, chunk_size, with_entropy
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, labels, lse, ent = ctx.saved_tensors
        t, size = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not ctx.with_entropy:
            g_ent = None
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None
        acc = lse.dtype
        # Low-precision models: accumulate the weight's gradient over chunks in float32, round once.
        w_acc = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=w_acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=w_acc, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], size):
            sl = slice(s, s + size)
            h = hidden[sl]
            logp, _ = _chunk_log_softmax(h, weight, bias, t, lse[sl])
            p = logp.exp()
            if g_ent is not None:
                grad = logp.add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None].to(acc))
            else:
                grad = logp.zero_()
            if g_lp is not None:
                gl = g_lp[sl, None].to(acc)
                grad.addcmul_(p, gl, value=-1).scatter_add_(-1, labels[sl, None], gl)
            del p
            gz = grad.div_(t).to(hidden.dtype)
            if need_h:
                grad_h[sl] = gz @ weight
            if need_w:
                grad_w.addmm_(gz.t().to(w_acc), h.to(w_acc))
            if need_b:
                grad_b.add_(gz.sum(0, dtype=w_acc))
            del grad, gz
        if need_w:
            grad_w = grad_w.to(weight.dtype)
        if need_b:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`memory` mode on already gathered hidden states [N, H]: ([N], [N] or None)."""
    if chunk_size < 1:
        raise ValueError(f"logits chunk size must be >= 1, got {chunk_size}")
    lp, ent = ChunkedLogProbs.apply(
        hidden, lm_head.weight, lm_head.bias, labels, float(temperature), int(chunk_size), bool(calculate_entropy)
    )
    return lp, (ent if calculate_entropy else None)


def check_temperature(temperature: object) -> float:
    """`temperature` as a float, refusing anything but a finite real number > 0: a string or a bool
    would pass `float()` (or `> 0`) and then scale the logits as a different value or fail deep inside."""
    if isinstance(temperature, (str, bytes, bool)):
        raise ValueError(f"temperature must be a finite number > 0, got {type(temperature).__name__} {temperature!r}")
    try:
        t = float(temperature)  # type: ignore[arg-type]  # anything float() takes: int, numpy or 0-d tensor
    except (TypeError, ValueError):
        raise ValueError(
            f"temperature must be a finite number > 0, got {type(temperature).__name__} {temperature!r}"
        ) from None
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return t


def response_logprobs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    index: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    mode: str = "compute",
    chunk_size: Optional[int] = None,
    memory_budget_mib: Optional[float] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of labels[i] predicted at hidden[index[i]]; hidden is [T, H]. Returns ([N], [N] or None).

    `memory` mode: `chunk_size` positions per chunk if given, else as many as fit
    `memory_budget_mib` (default DEFAULT_LOGITS_MEMORY_BUDGET_MIB).
    """
    if mode not in LOGITS_MODES:
        raise ValueError(f"unknown logits_mode {mode!r}; choose one of {LOGITS_MODES}")
    temperature = check_temperature(temperature)
    if mode == "none":
        logits = lm_head(hidden)[index]
        return _lp_entropy(logits, labels, temperature, calculate_entropy)
    h = hidden[index]
    if mode == "compute":
        return _lp_entropy(lm_head(h), labels, temperature, calculate_entropy)
    if not isinstance(lm_head, nn.Linear):
        raise ValueError(f"logits_mode 'memory' needs an nn.Linear lm_head, got {type(lm_head).__name__}")
    if chunk_size is None:
        budget = DEFAULT_LOGITS_MEMORY_BUDGET_MIB if memory_budget_mib is None else memory_budget_mib
        chunk_size = chunk_size_for_budget(lm_head.out_features, budget, h.dtype)
    return chunked_logprobs(h, lm_head, labels, temperature, calculate_entropy, chunk_size)
