"""Mask mode through FlexAttention: the plan's block mask as a BlockMask, no copy of any K/V.

Blocks of the [T, T] mask that are all-masked (a response against another response of its
group, any pair across groups) are skipped by the kernel, so the work is the attended pairs
rounded up to 128 x 128 blocks.

Where it runs:
- CUDA: flex_attention compiled once with dynamic shapes (a new batch shape does not recompile),
  forward and backward through Inductor's kernels, which use the block tables.
- CPU: flex_attention uncompiled. PyTorch's eager flex_attention evaluates `mask_mod` densely
  over [T, T] (no block skipping: the cost of eager/sdpa mask mode, slower) and has a backward,
  but flex_attention refuses any CPU input that requires grad (`_validate_device`: Inductor has
  no CPU backward kernel). zorro lifts that one rule for its own calls only (`_cpu_grad_allowed`:
  for the calling thread, while its call runs; every other check still applies) and runs the
  eager path, which matches the per-sequence float64 reference (tests/test_flex_cpu.py). Not
  compiled on CPU: Inductor's CPU flex has no backward, takes ~15 s to compile a shape, and with
  `dynamic=True` fails to compile a tree-style mask (torch 2.13: `cur_kvSplitSize` undeclared in
  the generated C++); a compiled CPU forward with `dynamic=False` is exact (slow test).

Traps handled: the packed length is padded to a multiple of 128 (Inductor asserts on ragged
lengths in backward); padding tokens form their own causal group so no query row is empty.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from zorro_core.plan.prompt import DedupPlan

BLOCK = 128


def flex_unavailable(device: torch.device | str) -> Optional[str]:
    """Why flex attention cannot train on `device`, or None."""
    device = torch.device(device)
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return f"torch {torch.__version__} has no flex_attention"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        import torch.nn.attention.flex_attention as fa  # lazy: as in _compiled

        if not callable(getattr(fa, "_validate_device", None)):
            return (
                f"torch {torch.__version__}: flex_attention refuses backward on CPU and zorro cannot lift "
                "that check (no flex_attention._validate_device); use split mode or eager/sdpa mask mode"
            )
        return None
    return f"flex mask mode runs on CUDA or CPU, not {device.type}; use split mode or eager/sdpa mask mode"


_lift_lock = threading.Lock()
_lifted_for: Optional[int] = None  # the thread whose flex call runs with CPU grads allowed


@contextmanager
def _cpu_grad_allowed() -> Iterator[None]:
    """Within this block, the calling thread's flex_attention calls on CPU accept inputs that
    require grad; nothing else changes (other threads, other devices and every other check of
    `_validate_device` are as in torch). Calls are serialised: one thread at a time holds it."""
    import torch.nn.attention.flex_attention as fa  # lazy: as in _compiled

    global _lifted_for
    with _lift_lock:
        original = fa._validate_device

        def validate(query, key, value):
            if threading.get_ident() == _lifted_for and query.device.type == "cpu":
                # the rule lifted is "no input requires grad on CPU": check the rest on detached views
                return original(query.detach(), key.detach(), value.detach())
            return original(query, key, value)

        fa._validate_device = validate
        _lifted_for = threading.get_ident()
        try:
            yield
        finally:
            _lifted_for = None
            fa._validate_device = original


def _eager_cpu(q, k, v, *, block_mask, scale, enable_gqa):
    from torch.nn.attention.flex_attention import flex_attention  # lazy: as in _compiled

    with _cpu_grad_allowed(), warnings.catch_warnings():
        # its advice (torch.compile it) does not hold on CPU with grads: see the module docstring
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def _kernel(device: torch.device):
    """The flex_attention zorro calls on `device`: compiled on CUDA, eager (grads allowed) on CPU."""
    return _eager_cpu if device.type == "cpu" else _compiled()


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
    out = _kernel(q.device)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, :t].transpose(1, 2)
