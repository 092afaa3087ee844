"""The gated delta rule in its inputs' precision, without transformers' cast to float32.

transformers' chunked algorithm (WY/UT form), computing in float64 for float64 inputs. The proof's reference and baseline run
it in float64 models (zorro_core.verify.delta_rule, which describes its use and its checks), and the
self-check takes it, in float64, as the reference against which the model's own float32 kernel is
judged (zorro_core.actor.self_check). Here, below both, so that the actor need not import the proof.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["chunk_gated_delta_rule_exact"]


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule_exact(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g, beta [B, L, Hv]; returns ([B, L, Hv, Dv], [B, Hv, Dk, Dv] or None)."""
    if kwargs.get("cu_seqlens") is not None:
        raise ValueError("chunk_gated_delta_rule_exact does not take cu_seqlens (run a padded batch)")
    out_dtype = query.dtype
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    b, length, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(acc) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (length + pad) // chunk_size
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(b, hv, n, chunk_size, -1) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, hv, n, chunk_size).cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * g.exp()[..., None], upper=False, unitriangular=True)
    state = q.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.to(acc)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    outs = []
    for i in range(n):
        v_i = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_i)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_i
    out = torch.stack(outs, 2).reshape(b, hv, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(out_dtype).contiguous(), (state if output_final_state else None)
