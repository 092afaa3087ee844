"""Mask mode through FlexAttention: the plan's block mask as a BlockMask, no copy of any K/V.

Blocks of the [T, T] mask that are all-masked (a response against another response of its
group, any pair across groups) are skipped by the kernel, so the work is the attended pairs
rounded up to 128 x 128 blocks. Needs a CUDA device for backward (PyTorch has no CPU
backward for flex_attention); forward runs on CPU too, compiled, which is slow to warm up.

Traps handled: the packed length is padded to a multiple of 128 (Inductor asserts on ragged
lengths in backward); padding tokens form their own causal group so no query row is empty;
the kernel is compiled once with dynamic shapes, so a new batch shape does not recompile.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

from zorro_core.plan.prompt import DedupPlan

BLOCK = 128


def flex_unavailable(device: torch.device | str) -> Optional[str]:
    """Why flex attention cannot train on `device`, or None."""
    device = torch.device(device)
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no flex_attention"
    if device.type != "cuda":
        return "flex_attention has no backward on CPU (PyTorch); use split mode or eager/sdpa mask mode"
    return None


@lru_cache(maxsize=1)
def _compiled():
    # lazy: FlexAttention is heavy and loads only when mask mode runs it
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def block_mask(plan: DedupPlan, window: Optional[int] = None):
    """The plan's mask-mode mask as a BlockMask over the packed length padded to BLOCK."""
    # lazy: as in _compiled
    from torch.nn.attention.flex_attention import create_block_mask

    t = plan.num_tokens
    padded = -(-t // BLOCK) * BLOCK
    pad = padded - t
    group = F.pad(plan.token_group, (0, pad), value=-1)
    segment = F.pad(plan.token_segment, (0, pad), value=-1)
    is_prompt = F.pad(plan.token_segment < plan.num_groups, (0, pad), value=False)
    pos = F.pad(plan.position_ids, (0, pad), value=0)

    def mask_mod(b, h, q, kv):
        allowed = (group[q] == group[kv]) & (kv <= q) & (is_prompt[kv] | (segment[q] == segment[kv]))
        if window is not None:
            allowed = allowed & (pos[q] - pos[kv] < window)
        return allowed

    return create_block_mask(mask_mod, 1, None, padded, padded, device=plan.device)


def flex_packed_attention(query, key, value, mask, scale: float) -> torch.Tensor:
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, D] (transformers' layout)."""
    t = query.shape[2]
    pad = mask.shape[-1] - t
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    out = _compiled()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, :t].transpose(1, 2)
