"""Load flash-attn's real interface at a release over the CPU kernel, and torch's aten flash ops on
CPU: context managers that undo everything they register (tests only).

- `flash_attn_release(version)`: `flash_attn_2_cuda` is flash_attn_ext's CPU module; `flash_attn`
  is the release's own package from its sdist (tests.kernel_emulation.sdists). From 2.7 the
  interface registers its functions as torch.library custom ops for CUDA only: each gets a CPU
  kernel, its own Python function (which calls the emulated module), so the decorated callables
  (CustomOpDef, called by keyword as on the GPU) run on CPU tensors. On exit the ops are deleted
  (their library destroyed), so another release can register the same names.
- `aten_flash_on_cpu()`: CPU kernels for `aten::_flash_attention_forward/_backward` (CUDA-only ops)
  with the vendored kernel's contract (flash_core), so torch_varlen's pair and torch's own
  varlen_attn run their real op calls on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Iterator, Optional

import torch

from tests.kernel_emulation import flash_core, sdists
from tests.kernel_emulation.flash_attn_ext import make_extension
from tests.kernel_emulation.flash_core import Calls

_MODULES = ("flash_attn_2_cuda", "flash_attn", "flash_attn.flash_attn_interface")


def _custom_op_names() -> set[str]:
    from torch._library import custom_ops

    return {n for n in custom_ops.OPDEFS if n.startswith("flash_attn::")}


LATEST = sdists.VERSIONS[-1]


@contextlib.contextmanager
def flash_attn_release(version: str = LATEST, calls: Optional[Calls] = None) -> Iterator[Any]:
    """flash-attn `version`'s real `flash_attn.flash_attn_interface` over the CPU kernel (yielded);
    the kernel's forward calls are recorded in `calls`."""
    from torch._library import custom_ops

    folder = sdists.package_dir(version)
    if not (folder / "flash_attn" / "flash_attn_interface.py").is_file():
        raise FileNotFoundError(
            f"flash-attn {version}'s package is not in {folder}: python -m tests.kernel_emulation.sdists"
        )
    if _custom_op_names():
        raise RuntimeError(f"flash_attn custom ops are already registered here: {sorted(_custom_op_names())}")
    saved = {n: sys.modules.pop(n, None) for n in _MODULES}
    sys.modules["flash_attn_2_cuda"] = make_extension(version, calls)
    sys.path.insert(0, str(folder))
    try:
        importlib.invalidate_caches()
        pkg = importlib.import_module("flash_attn")
        assert pkg.__version__ == version, (pkg.__version__, version)
        interface = importlib.import_module("flash_attn.flash_attn_interface")
        for name in _custom_op_names():
            op = custom_ops.OPDEFS[name]
            op.register_kernel("cpu")(op._init_fn)  # the release's own function, on the emulated module
        yield interface
    finally:
        for name in _custom_op_names():
            custom_ops.OPDEFS.pop(name)._lib._destroy()
            ns = getattr(torch.ops, "flash_attn", None)
            short = name.split("::", 1)[1]
            if ns is not None and short in ns.__dict__:
                delattr(ns, short)  # the cached packet of the deleted op
        sys.path.remove(str(folder))
        for n in _MODULES:
            sys.modules.pop(n, None)
            if saved[n] is not None:
                sys.modules[n] = saved[n]


_aten_calls: list[Optional[Calls]] = [None]


def _aten_forward(
    query,
    key,
    value,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
    seqused_k=None,
    alibi_slopes=None,
    block_table=None,
    num_splits=None,
):
    flash_core.check(cum_seq_q is not None and cum_seq_k is not None, "emulation: the varlen call only")
    flash_core.check(seqused_k is None and alibi_slopes is None and block_table is None, "emulation: plain call only")
    flash_core.check(not return_debug_mask, "emulation: no debug mask")
    s = scale if scale is not None else query.shape[-1] ** -0.5
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    if _aten_calls[0] is not None:
        _aten_calls[0].record(left, right, is_causal)
    out, lse = flash_core.varlen_forward(
        query, key, value, cum_seq_q, cum_seq_k, int(max_q), int(max_k), dropout_p, s, is_causal, left, right
    )
    empty = torch.empty(0, dtype=query.dtype)
    return out, lse, torch.zeros(2, dtype=torch.uint64), empty, empty


def _aten_backward(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    rng_state,
    unused,
    *,
    scale: Optional[float] = None,
    window_size_left: Optional[int] = None,
    window_size_right: Optional[int] = None,
):
    s = scale if scale is not None else query.shape[-1] ** -0.5
    left = -1 if window_size_left is None else int(window_size_left)
    right = -1 if window_size_right is None else int(window_size_right)
    # torch's _flash_attention_backward makes grad_out contiguous and hands the lse as it is
    dq, dk, dv, _ = flash_core.varlen_backward(
        grad_out.contiguous(), query, key, value, out, logsumexp, None, None, None,
        cum_seq_q, cum_seq_k, int(max_q), int(max_k), dropout_p, s, is_causal, left, right,
    )  # fmt: skip
    return dq, dk, dv


@contextlib.contextmanager
def aten_flash_on_cpu(calls: Optional[Calls] = None) -> Iterator[None]:
    """`aten::_flash_attention_forward/_backward` runnable on CPU tensors, for the duration (forward
    calls recorded in `calls`)."""
    lib = torch.library.Library("aten", "IMPL")
    _aten_calls[0] = calls
    try:
        lib.impl("_flash_attention_forward", _aten_forward, "CPU")
        lib.impl("_flash_attention_backward", _aten_backward, "CPU")
        yield
    finally:
        _aten_calls[0] = None
        lib._destroy()


def require_sdists() -> None:
    """Skip (fail where ZORRO_FLASH_ATTN_SDISTS_REQUIRED is set, as in CI) when a release's package is missing."""
    import os

    import pytest

    miss = sdists.missing()
    if miss:
        msg = f"flash-attn {', '.join(miss)} not in {sdists.CACHE}: run python -m tests.kernel_emulation.sdists"
        if os.environ.get(sdists.REQUIRED_ENV):
            pytest.fail(msg)
        pytest.skip(msg)


class Emulation:
    """The kernels' emulation for one test (the `kernel_emulation` fixture): what it enters is
    undone when the test ends."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self._stack = stack

    def flash_attn(self, version: str = LATEST, calls: Optional[Calls] = None) -> Any:
        """flash-attn `version`'s real interface over the CPU kernel (its module returned)."""
        require_sdists()
        return self._stack.enter_context(flash_attn_release(version, calls))

    def aten(self, calls: Optional[Calls] = None) -> None:
        """torch's aten flash ops on CPU."""
        self._stack.enter_context(aten_flash_on_cpu(calls))
