"""Attention backends of split mode: one protocol for the plan's two calls.

    backend.causal(q, k, v, seg, scale, window, layouts)   # self-causal segments: q, k, v the same tokens
    backend.cross(q, k, v, seg, scale, window, layouts)    # responses against [their prompt | themselves]
    backend.tree_level(q, k, v, level, scale, window, layouts)  # a trie level's nodes against [parent's path | own]

In `causal`, q [Tq, Hq, D] and k, v [Tk, Hkv, D] hold the segments of `seg` back to back. In
`cross`, q holds the cross segments' queries and k, v the whole packed row: `seg.k_index` (or,
for the padded backends, the plan's cross layout) picks each segment's keys. Both are
`varlen`: attention over segments back to back (seg.cu_q, seg.cu_k), causal aligned
bottom-right: query i of a segment with Lq queries and Lk keys sees keys 0..i + Lk - Lq
(flash-attn's convention; SDPA's `is_causal` aligns top-left, which is wrong when Lq != Lk).
`window` (if set) also hides keys more than window - 1 positions behind the query. GQA: Hq must
be a multiple of Hkv. v's head dim may differ from q's and k's (MLA): out is [Tq, Hq, Dv].
`layouts` is the plan's (zorro_core.attention.layouts.layouts_of): what a backend derives from the
segments is built once per plan there; None (bare segments) builds it for the call alone.

- `reference`: explicit softmax(QK^T)V over a padded batch of segments, softmax in float32
  (float64 for float64 inputs). Exact, runs anywhere; the oracle for the others.
- `sdpa`: the same padded batch through F.scaled_dot_product_attention (CPU or GPU).
- `flash_cpu`: torch's CPU flash kernel through the gather-free split path (below): the GPU
  path's own code on CPU.
- `torch_varlen`: torch's CUDA flash kernel (the ops under torch.nn.attention.varlen.varlen_attn).
- `flash_attn`: flash-attn 2's varlen kernel (CUDA, needs the flash-attn package).
- `flash_cpu_gather`: `flash_cpu`'s kernel on the pre-merge GPU path (a copy of the prompt's K/V
  gathered per response, causal and cross outputs concatenated); kept to measure what the merged
  path saves (`zorro bench memory`), exact like the rest.

The backends with a kernel pair (`pair`: zorro_core.attention.kernels) run split mode gather-free
(`gather_free`, zorro_core.attention.merged): the prompt's keys in place, partial outputs merged by
log-sum-exp into one output. A sliding window that cuts a prompt keeps the gather path (said once).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from zorro_core.attention.head_dims import crop, same_head_dim
from zorro_core.attention.kernels import (
    HALF,
    CpuFlashPair,
    FlashAttnPair,
    KernelPair,
    TorchFlashPair,
    cuda_pair_refusal,
    flash_attn_missing,
)
from zorro_core.attention.layouts import Layouts
from zorro_core.attention.merged import MergedSplitAttention, VarlenCall, merge_refusal
from zorro_core.attention.padded import (
    attend,
    cpu_flash_unavailable,
    cross_attention,
    cross_blocks_attention,
    from_padded,
    to_padded,
)
from zorro_core.plan.protocol import Plan
from zorro_core.plan.segments import Segments
from zorro_core.plan.trie_levels import TreeLevel


class AttentionBackend:
    """One way to run variable-length attention; `causal` and `cross` are the plan's two calls."""

    name: str = ""
    pair: Optional[KernelPair] = None
    """The kernel's forward/backward pair when it runs the gather-free split path."""

    def gather_free(self, plan: Plan, q: torch.Tensor, window: Optional[int]) -> bool:
        """Whether split mode over `plan` runs gather-free (zorro_core.attention.merged) here."""
        if self.pair is None:
            return False
        why = merge_refusal(plan, window)
        if why:
            warnings.warn(f"zorro: {self.name} runs the gather path for this plan: {why}", RuntimeWarning, stacklevel=2)
        return why is None

    def kernel_pair(self, dtype: torch.dtype) -> Optional[KernelPair]:
        """The kernel pair that runs gather-free calls on inputs of `dtype` here (None: none does)."""
        return self.pair

    def varlen(
        self, q, k, v, seg: Segments, scale: float, window: Optional[int] = None, layouts: Optional[Layouts] = None
    ) -> torch.Tensor:
        """Segments of q and k, v back to back, causal aligned bottom-right -> [Tq, Hq, D]."""
        raise NotImplementedError

    def causal(
        self, q, k, v, seg: Segments, scale: float, window: Optional[int] = None, layouts: Optional[Layouts] = None
    ) -> torch.Tensor:
        """The plan's self-causal segments (queries are keys)."""
        return self.varlen(q, k, v, seg, scale, window, layouts)

    def cross(
        self, q, k, v, seg: Segments, scale: float, window: Optional[int] = None, layouts: Optional[Layouts] = None
    ) -> torch.Tensor:
        """The plan's cross segments: q their queries, k, v the whole packed row."""
        return self.varlen(q, k[seg.k_index], v[seg.k_index], seg, scale, window, layouts)

    def tree_level(
        self, q, k, v, level: TreeLevel, scale: float, window: Optional[int] = None, layouts: Optional[Layouts] = None
    ) -> torch.Tensor:
        """A prefix-tree level (zorro_core.attention.tree): q the level's queries, k, v the whole
        packed row; each node's keys are its parent's path followed by its own tokens. By default
        one gather of [path | own] per node (`Layouts.level_k_index`) through `varlen`."""
        layouts = layouts or Layouts()
        idx = layouts.level_k_index(level, q.device)
        return self.varlen(q, k[idx], v[idx], level.seg, scale, window, layouts)

    def unavailable(self, device: torch.device) -> Optional[str]:
        """Why the backend cannot run on `device` here, or None when it can."""
        return None


class PaddedBackend(AttentionBackend):
    """Segments as a padded batch (zorro_core.attention.padded): a shared key block (a prompt, a
    parent's path) is taken once per group and broadcast to its members, not gathered per member."""

    exact = False
    """Explicit scores with a float32 (float64) softmax rather than F.scaled_dot_product_attention."""

    def tree_level(self, q, k, v, level, scale, window=None, layouts=None):
        layouts = layouts or Layouts()
        lay = layouts.level_cross(level, q.device)
        seg = level.seg
        if not lay.uniform_p:  # the parents' paths are scattered over the packed row: gather them once
            rows, seg, lay = layouts.level_compact(level, q.device)
            k, v = k[rows], v[rows]
        return cross_blocks_attention(q, k, v, seg, lay, scale, window, self.exact)


class ReferenceBackend(PaddedBackend):
    """Exact: explicit scores over a padded batch; the cross call broadcasts each prompt block."""

    name = "reference"
    exact = True

    def varlen(self, q, k, v, seg, scale, window=None, layouts=None):
        lay, qp, kp, vp = to_padded(q, k, v, seg, layouts)
        return from_padded(attend(qp, kp, vp, lay, window, scale, exact=True), lay)

    def cross(self, q, k, v, seg, scale, window=None, layouts=None):
        return cross_attention(q, k, v, seg, scale, window, True, layouts)


class SdpaBackend(PaddedBackend):
    """F.scaled_dot_product_attention over a padded batch; on CPU the cross call saves no K/V copy."""

    name = "sdpa"

    def varlen(self, q, k, v, seg, scale, window=None, layouts=None):
        lay, qp, kp, vp = to_padded(q, k, v, seg, layouts)
        if seg.q_is_k and window is None:
            # Self-causal segments padded at their end: top-left `is_causal` is then exact for the
            # real queries (padding keys come after them) and lets the kernel skip masked blocks,
            # about half the work of an explicit mask.
            return from_padded(attend(qp, kp, vp, None, None, scale, exact=False), lay)
        return from_padded(attend(qp, kp, vp, lay, window, scale, exact=False), lay)

    def cross(self, q, k, v, seg, scale, window=None, layouts=None):
        return cross_attention(q, k, v, seg, scale, window, False, layouts)


def pair_varlen(q, k, v, seg: Segments, scale: float, pair: KernelPair) -> torch.Tensor:
    """One causal (bottom-right) varlen call through a kernel pair, saving what flash-attn saves."""
    call = VarlenCall(0, seg.total_q, 0, seg.total_k, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, True)
    return MergedSplitAttention.apply(q, k, v, [call], pair, scale)


class FlashCpuBackend(SdpaBackend):
    """torch's CPU flash kernel on the GPU path's code: split mode gather-free through the kernel
    pair; a window that cuts a prompt (and a dtype whose kernel probe failed) runs sdpa's path."""

    name = "flash_cpu"
    pair = CpuFlashPair()

    def gather_free(self, plan, q, window):
        return cpu_flash_unavailable(q.dtype) is None and super().gather_free(plan, q, window)

    def kernel_pair(self, dtype):
        return self.pair if cpu_flash_unavailable(dtype) is None else None


class FlashCpuGatherBackend(AttentionBackend):
    """The pre-merge GPU path with the CPU flash kernel: each response's [prompt | own] keys gathered
    and saved by the kernel's call, the causal and cross outputs concatenated (for comparisons)."""

    name = "flash_cpu_gather"

    def varlen(self, q, k, v, seg, scale, window=None, layouts=None):
        if window is not None:
            return SdpaBackend.varlen(BACKENDS["sdpa"], q, k, v, seg, scale, window, layouts)
        return pair_varlen(q, k, v, seg, scale, FlashCpuBackend.pair)

    def unavailable(self, device):
        return FlashCpuBackend.pair.unavailable(device)


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _varlen_attn_takes(name: str) -> bool:
    # lazy: not every torch has torch.nn.attention.varlen (unavailable() says so first)
    from torch.nn.attention.varlen import varlen_attn

    return name in inspect.signature(varlen_attn).parameters


def varlen_attn_refusal() -> Optional[str]:
    """Why this torch's varlen_attn cannot take zorro's call, or None: it needs `scale` (zorro's
    models pass their own) and `window_size` (the causal flag and sliding windows), which torch 2.10's
    lacks (both arrived in 2.11)."""
    missing = [n for n in ("scale", "window_size") if not _varlen_attn_takes(n)]
    if missing:
        return f"torch {torch.__version__}'s varlen_attn takes no {' or '.join(missing)} (torch >= 2.11 does)"
    return None


def _window_size(window: Optional[int]) -> tuple[int, int]:
    return (-1 if window is None else window - 1, 0)


def _seqlens(seg: Segments, device: torch.device) -> tuple:
    """cu_seqlens_q, cu_seqlens_k (on the kernel's device), max_seqlen_q, max_seqlen_k: the
    positional arguments both CUDA varlen kernels take after q, k, v."""
    return seg.cu_q.to(device), seg.cu_k.to(device), seg.max_q, seg.max_k


class CudaVarlenBackend(AttentionBackend):
    """A cu_seqlens kernel that runs on CUDA only; `missing` says what this install lacks for it.

    Both kernels take one head dim for q, k and v: with MLA's Dv != Dq they get them zero-padded to
    one and the output is cropped to Dv (exact: zorro_core.attention.head_dims)."""

    pad_to: int = 1
    """Head dims are zero-padded to a multiple of this (torch's private flash op takes multiples of 8)."""

    def varlen(self, q, k, v, seg, scale, window=None, layouts=None):
        q, k, v, dv = same_head_dim(q, k, v)
        d = q.shape[-1]
        padded = -(-d // self.pad_to) * self.pad_to
        if padded != d:  # exact: zero columns add 0 to every score, the scale is passed explicitly
            q, k, v = (F.pad(x, (0, padded - d)) for x in (q, k, v))
        return crop(self.kernel(q, k, v, seg, scale, window), dv)

    def kernel(self, q, k, v, seg: Segments, scale: float, window: Optional[int]) -> torch.Tensor:
        """The kernel's call on q, k, v of one head dim."""
        raise NotImplementedError

    def missing(self) -> Optional[str]:
        """Why the kernel is not importable here, or None."""
        raise NotImplementedError

    def unavailable(self, device):
        return cuda_pair_refusal(self.name, device) or self.missing()


class TorchVarlenBackend(CudaVarlenBackend):
    """torch.nn.attention.varlen.varlen_attn on cu_seqlens (CUDA)."""

    name = "torch_varlen"
    pair = TorchFlashPair()
    pad_to = 8

    def varlen(self, q, k, v, seg, scale, window=None, layouts=None):
        if q.dtype not in HALF:
            raise ValueError(f"torch_varlen runs float16/bfloat16 only, not {q.dtype}; use the sdpa backend")
        why = varlen_attn_refusal()
        if why:  # route the call, exactly, through sdpa's padded batch (said once)
            _warn_once("varlen_attn", f"zorro: torch_varlen's gather path runs sdpa instead: {why}")
            return BACKENDS["sdpa"].varlen(q, k, v, seg, scale, window, layouts)
        return super().varlen(q, k, v, seg, scale, window, layouts)

    def kernel(self, q, k, v, seg, scale, window):
        # lazy: not every torch has it (see _varlen_attn_takes)
        from torch.nn.attention.varlen import varlen_attn

        gqa = {}
        if q.shape[1] != k.shape[1]:
            if _varlen_attn_takes("enable_gqa"):
                gqa["enable_gqa"] = True
            else:
                # torch < 2.12's varlen_attn has no enable_gqa (seen on 2.11 on an H200): expand
                # the K/V heads to the query heads, which is what GQA computes.
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return varlen_attn(
            q,
            k,
            v,
            *_seqlens(seg, q.device),
            scale=scale,
            window_size=_window_size(window),
            **gqa,
        )

    def missing(self):
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
        return self.pair.unavailable(torch.device("cuda")) if self.pair is not None else None


class FlashAttnBackend(CudaVarlenBackend):
    """flash_attn.flash_attn_varlen_func on cu_seqlens (CUDA, the flash-attn package)."""

    name = "flash_attn"
    pair = FlashAttnPair()

    def kernel(self, q, k, v, seg, scale, window):
        # lazy: flash-attn is an optional package (unavailable() checks it)
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(
            q,
            k,
            v,
            *_seqlens(seg, q.device),
            softmax_scale=scale,
            causal=True,
            window_size=_window_size(window),
        )

    def missing(self):
        return flash_attn_missing()


BACKENDS: dict[str, AttentionBackend] = {
    b.name: b
    for b in (
        ReferenceBackend(),
        SdpaBackend(),
        FlashCpuBackend(),
        TorchVarlenBackend(),
        FlashAttnBackend(),
        FlashCpuGatherBackend(),
    )
}


def backend_unavailable(name: str, device: torch.device | str) -> Optional[str]:
    """Why backend `name` cannot run on `device` here, or None when it can."""
    if name not in BACKENDS:
        return f"unknown varlen backend {name!r}; choose one of {sorted(BACKENDS)}"
    return BACKENDS[name].unavailable(torch.device(device))


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    why = backend_unavailable(name, device)
    if why:
        raise ValueError(why)
    return BACKENDS[name]


def default_backend(attn_implementation: str, device: torch.device | str, dtype: Optional[torch.dtype] = None) -> str:
    """The varlen backend that split mode uses for a model's attention implementation and compute
    `dtype` (None: assumed float16/bfloat16). "sdpa" on CUDA takes torch's flash kernel pair only for
    float16/bfloat16 (the kernel's dtypes); a float32 model keeps sdpa's own padded path."""
    device = torch.device(device)
    if attn_implementation == "eager":
        return "reference"
    if attn_implementation.startswith("flash_attention"):
        return "flash_attn"
    half = dtype is None or dtype in HALF
    if device.type == "cuda" and half and backend_unavailable("torch_varlen", device) is None:
        return "torch_varlen"
    return "sdpa"
