"""Unequal query/key and value head dims (DeepSeek's MLA: Dq = qk_nope + qk_rope, Dv = v_head_dim).

softmax(Q K^T) V needs q and k to share a head dim, not v; the explicit paths (`reference`,
F.scaled_dot_product_attention, eager, flex) take Dv != Dq as they are. The flash kernels do not:
flash-attn 2, torch's varlen_attn and torch's private CPU flash op take one head dim for all three
(the CPU op raises "Q/K/V should have the same head size"). Zero columns change nothing exactly: a
zero column of V gives a zero column of the output, which is cropped, and a zero column of Q and K
adds 0 to every score (the softmax scale is always passed explicitly, never derived from the
padded width). So such a kernel gets q, k, v padded with zeros to the larger head dim and its
output is cropped back to Dv, which is what transformers' own flash path does for MLA (it pads V).
Backward through the pad and the crop drops the padding's gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def same_head_dim(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(q, k, v) zero-padded on the last dim to one head dim, and v's own head dim (to crop to).

    Unchanged (no copy) when the dims already agree."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"queries and keys need one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    dq, dv = q.shape[-1], v.shape[-1]
    if dv < dq:
        v = F.pad(v, (0, dq - dv))
    elif dv > dq:
        q, k = F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq))
    return q, k, v, dv


def crop(out: torch.Tensor, dv: int) -> torch.Tensor:
    """The kernel's output back to the value head dim `dv` (a view when no padding was added)."""
    return out if out.shape[-1] == dv else out[..., :dv]
