"""Test-only stand-in for flash_attn.bert_padding: the same functions in plain torch (differentiable indexing).

Semantics follow flash-attn 2.8's bert_padding: rows flattened batch-major, `indices` the flat positions where
the mask is 1, `cu_seqlens` the int32 cumulative lengths with a leading 0.
"""

import torch
import torch.nn.functional as F
from einops import rearrange

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    out = values.new_zeros((first_axis_dim, *values.shape[1:]))
    return out.index_put((indices,), values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (
        index_first_axis(rearrange(hidden_states, "b s ... -> (b s) ..."), indices),
        indices,
        cu_seqlens,
        max_seqlen_in_batch,
        used_seqlens_in_batch,
    )


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return rearrange(output, "(b s) ... -> b s ...", b=batch)
