"""A CPU `flash_attn_2_cuda` (the compiled module flash-attn's interface imports), per release.

`varlen_fwd` and `varlen_bwd` take exactly the positional arguments each release's interface passes
(the pybind signatures of csrc/flash_attn/flash_api.cpp's mha_varlen_fwd / mha_varlen_bwd, the same
21 and 24 at 2.6.3, 2.7.4.post1 and 2.8.3.post2) and return that release's tuple: 2.6 returns
(out, q_padded, k_padded, v_padded, out_padded, softmax_lse, p, rng_state) and pads a head dim that
is not a multiple of 8 itself (its backward takes dout at the unpadded head dim); 2.7+ returns
(out, softmax_lse, p, rng_state) and refuses one. The rest of the module (fwd, bwd, fwd_kvcache)
raises: zorro calls only the varlen pair.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F

from tests.kernel_emulation import flash_core
from tests.kernel_emulation.flash_core import Calls, check


def _version(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def make_extension(version: str, calls: Optional[Calls] = None) -> types.ModuleType:
    """The module `flash_attn_2_cuda` of flash-attn `version`, on CPU (forward calls recorded in `calls`)."""
    old = _version(version) < (2, 7)
    mod = types.ModuleType("flash_attn_2_cuda")
    mod.__doc__ = f"CPU emulation of flash-attn {version}'s compiled module (tests/kernel_emulation)."

    def varlen_fwd(*args):
        check(len(args) == 21, f"varlen_fwd(): incompatible function arguments ({len(args)} given, 21 taken)")
        (q, k, v, out_, cu_q, cu_k, seqused_k, leftpad_k, block_table, alibi, max_q, max_k, p_dropout, scale,
         zero_tensors, causal, wl, wr, softcap, return_softmax, gen) = args  # fmt: skip
        check(
            out_ is None and seqused_k is None and leftpad_k is None and block_table is None,
            "emulation: plain call only",
        )
        check(alibi is None and softcap == 0.0 and not return_softmax and gen is None, "emulation: plain call only")
        for name, x in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            check(type(x) is int, f"varlen_fwd(): {name} must be an int, got {type(x).__name__}")
        if calls is not None:
            calls.record(wl, wr, causal)
        d = q.shape[-1]
        if old and d % 8:
            q, k, v = (F.pad(x, (0, 8 - d % 8)) for x in (q, k, v))  # 2.6's own padding
        out, lse = flash_core.varlen_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, p_dropout, scale, causal, wl, wr, head_multiple_of_8=not old
        )
        p = torch.empty(0, dtype=q.dtype)
        rng = torch.zeros(2, dtype=torch.int64)
        if old:
            return [out[..., :d], q, k, v, out, lse, p, rng]
        return [out, lse, p, rng]

    def varlen_bwd(*args):
        check(len(args) == 24, f"varlen_bwd(): incompatible function arguments ({len(args)} given, 24 taken)")
        (dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, alibi, max_q, max_k, p_dropout, scale, zero_tensors,
         causal, wl, wr, softcap, deterministic, gen, rng_state) = args  # fmt: skip
        check(alibi is None and softcap == 0.0 and gen is None, "emulation: plain call only")
        if old:  # 2.6 takes dout at the caller's head dim and pads it itself (q, k, v, out come padded)
            d_og = dout.shape[-1]
            check(q.shape[-1] == -(-d_og // 8) * 8, "head_size must be head_size_og rounded to a multiple of 8")
            check(dout.stride(-1) == 1, "dout tensor must have contiguous last dimension")
            if d_og % 8:
                dout = F.pad(dout, (0, 8 - d_og % 8))
        return flash_core.varlen_backward(
            dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, p_dropout, scale, causal, wl, wr
        )

    def _not_emulated(name):
        def fn(*args, **kwargs):
            raise NotImplementedError(
                f"emulation: flash_attn_2_cuda.{name} is not emulated (zorro calls the varlen pair)"
            )

        return fn

    mod.varlen_fwd = varlen_fwd
    mod.varlen_bwd = varlen_bwd
    for name in ("fwd", "bwd", "fwd_kvcache"):
        setattr(mod, name, _not_emulated(name))
    return mod
