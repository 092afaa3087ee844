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
  a context manager around each call, for the calling thread, while its call runs; every other
  check still applies) and runs the eager path, which matches the per-sequence float64 reference
  (tests/attention/test_flex_cpu.py). Since that hook is private, CPU flex is served only after a probe
  (`cpu_flex_probe`, once per process): a tiny masked GQA call, forward and backward through the
  lifted path, against float64 softmax attention; a missing hook or a failed probe refuses CPU
  flex with the reason. Not
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

from zorro_core.plan.prompt import PromptPlan

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
        why = cpu_flex_probe()
        if why is not None:
            return (
                f"torch {torch.__version__}: flex_attention on CPU with its backward check lifted does not "
                f"agree with float64 attention ({why}); use split mode or eager/sdpa mask mode"
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


# The probe against float64 math on the same inputs (float64 throughout: only the kernel's algorithm is in question).
_PROBE_TOL = 1e-10


@lru_cache(maxsize=1)
def cpu_flex_probe() -> Optional[str]:
    """None when eager flex_attention on CPU, called as zorro calls it (`_eager_cpu`, the grad check
    lifted), gives the output and the q, k, v gradients of float64 softmax attention on a tiny
    masked GQA case; else why not. Once per process.

    Its autograd graph is its own: the calling forward may be under no_grad, inference_mode or a
    checkpoint's saved-tensor hooks, none of which may reach the probe's tensors."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        identity = (lambda x: x, lambda x: x)
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(*identity):
            with torch.autocast("cpu", enabled=False):
                g = torch.Generator().manual_seed(0)  # a private generator: the global RNG untouched
                n = 6
                q, k, v, grad = (torch.randn(1, h, n, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
                # Two causal groups: rows 0-2 and 3-5, the second also blind to its first key.
                group = torch.tensor([0, 0, 0, 1, 1, 1])

                def mask_mod(b, h, qi, ki):
                    return (group[qi] == group[ki]) & (ki <= qi) & ((ki != 3) | (qi == 3))

                mask = create_block_mask(mask_mod, 1, None, n, n, device="cpu")
                scale = 0.3
                ins = [x.clone().requires_grad_() for x in (q, k, v)]
                out = _eager_cpu(*ins, block_mask=mask, scale=scale, enable_gqa=True)
                got = (out, *torch.autograd.grad(out, ins, grad))
                ref_ins = [x.clone().requires_grad_() for x in (q, k, v)]
                kr, vr = (x.repeat_interleave(2, dim=1) for x in ref_ins[1:])
                qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
                allowed = mask_mod(0, 0, qi, ki)
                scores = (ref_ins[0] @ kr.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
                ref = torch.softmax(scores, -1) @ vr
                want = (ref, *torch.autograd.grad(ref, ref_ins, grad))
        for what, a, b in zip(("output", "dq", "dk", "dv"), got, want):
            if a.shape != b.shape:
                return f"{what} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
            err = (a.detach().double() - b.detach()).abs().max().item()
            if not err <= _PROBE_TOL:
                return f"{what} differs from float64 softmax attention by {err:.2e} > {_PROBE_TOL:g}"
    except Exception as e:  # noqa: BLE001 - any failure of the private path means "not here"
        return f"{type(e).__name__}: {e}"
    return None


def _kernel(device: torch.device):
    """The flex_attention zorro calls on `device`: compiled on CUDA, eager (grads allowed) on CPU."""
    return _eager_cpu if device.type == "cpu" else _compiled()


@lru_cache(maxsize=1)
def _compiled():
    # lazy: FlexAttention is heavy and loads only when mask mode runs it
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def block_mask(plan: PromptPlan, window: Optional[int] = None):
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
