"""Varlen attention kernel pairs: a forward that returns the log-sum-exp, the backward that takes it.

The gather-free split path (zorro_core.attention.merged) runs several kernel calls into one output
and needs what a flash kernel computes internally: each call's log-sum-exp (to merge partial
outputs), and a backward it can hand the *merged* output and log-sum-exp. The public wrappers hide
both (flash-attn's `flash_attn_varlen_func` drops the lse's gradient; torch's `varlen_attn` saves
its own tensors), so each pair here calls the kernel's forward/backward ops directly:

    out, lse = pair.forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale)
    dq, dk, dv = pair.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)

q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv] hold the segments back to back (cu_q, cu_k: [n+1]
int32 offsets); out [Tq, Hq, Dv]; lse [Hq, Tq], float32 (float64 for float64 inputs): flash-attn 2's
varlen layout. `causal` is flash-attn's: aligned bottom-right (query i of a segment with Lq queries
and Lk keys sees keys 0..i + Lk - Lq); otherwise every query sees every key of its segment. A
segment may have no queries (its keys then get zero gradient).

- `flash_cpu`: torch's CPU flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
  backward) over a padded batch built inside each call (a transient, never saved), so CI and a
  machine without a GPU run the GPU path's own code.
- `torch_varlen`: `aten._flash_attention_forward/_backward` (CUDA), the ops under torch's varlen_attn.
- `flash_attn`: flash-attn 2's `_flash_attn_varlen_forward/_backward` (CUDA, flash-attn 2.6-2.8,
  where the varlen lse is [H, Tq]); called by keyword with the arguments and return tuple of the
  installed release (2.6 returns 8 values and takes `window_size`; 2.7+ registers both as
  torch.library custom ops, which have no inspectable signature, returns 4 and takes
  `window_size_left/right`). A release outside 2.6-2.8 is refused with its version.

The CUDA kernels read the lse from its data pointer as a dense [H, total_q] float32 block (strides
ignored) and check only its device: every lse handed to one here is that block (`kernel_lse`), and
every lse one returns is checked to be it (`checked_lse`), so a kernel that differs is a clear error,
not a wrong gradient. Both CUDA pairs refuse ROCm (AOTriton's varlen lse is padded) and any dtype
but float16/bfloat16 before a kernel runs. `max_seqlen_q` is passed as at least 2 (`kernel_max_q`):
with 1, GQA and no window the kernels take a decode shortcut (the "ngroups swap") that reshapes q
as if every segment had exactly one query, which a plan's call with an empty query segment breaks.
max_seqlen_q is only an upper bound the kernel sizes its grid by (no row is read past a segment's
cu_seqlens end), and with one query per segment bottom-right causal sees every key, so the result is
the same; only the shortcut's speed is lost, on calls of at most one query per segment.
"""
# Whole over ~450 lines: one protocol and its three pairs, each bound to keep to it (apart they would drift).

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from typing import Any, Optional

import torch
import torch.nn.functional as F


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for inputs of `dtype` (flash kernels keep it in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


HALF = (torch.float16, torch.bfloat16)


def kernel_max_q(max_q: int) -> int:
    """max_seqlen_q for a CUDA varlen kernel: at least 2, so it never takes the ngroups swap
    (module docstring); exact, max_seqlen_q being an upper bound."""
    return max(int(max_q), 2)


def kernel_lse(lse: torch.Tensor, q: torch.Tensor, kernel: str) -> torch.Tensor:
    """`lse` as the CUDA backward reads it: a dense contiguous [Hq, Tq] float32 block (a column
    slice of a wider lse is copied: the kernel ignores strides and would read other heads' rows)."""
    want = (q.shape[1], q.shape[0])
    if lse.dtype != torch.float32 or tuple(lse.shape) != want:
        raise RuntimeError(
            f"{kernel}: the lse handed to the backward must be float32 {list(want)}, got {lse.dtype} {list(lse.shape)}"
        )
    return lse.contiguous()


def checked_lse(lse: torch.Tensor, q: torch.Tensor, kernel: str) -> torch.Tensor:
    """The lse a CUDA forward returned, checked to be the layout zorro merges and hands back:
    float32 [Hq, Tq], dense (flash-attn 2's varlen layout). Anything else is refused by name."""
    want = (q.shape[1], q.shape[0])
    if lse.dtype != torch.float32 or tuple(lse.shape) != want or not lse.is_contiguous():
        raise RuntimeError(
            f"{kernel} returned an lse of {lse.dtype} {list(lse.shape)} (strides {lse.stride()}), where zorro needs "
            f"a contiguous float32 {list(want)} block (flash-attn 2's varlen layout): this kernel's layout differs, "
            "so its gradients would be wrong; use the sdpa backend"
        )
    return lse


def cuda_pair_refusal(name: str, device: torch.device) -> Optional[str]:
    """Why a CUDA kernel pair cannot run on `device` (before any kernel runs), or None."""
    if device.type != "cuda":
        return f"{name} needs a CUDA device (got {device.type})"
    if torch.version.hip:
        return (
            f"{name} is not supported on ROCm (torch {torch.__version__}, HIP {torch.version.hip}): its varlen "
            "kernel pads the lse, which the gather-free merge reads unpadded; use the sdpa backend"
        )
    return None


def check_half(q: torch.Tensor, name: str) -> None:
    """The CUDA flash kernels take float16/bfloat16 only: refused here, before the kernel, by name."""
    if q.dtype not in HALF:
        raise ValueError(f"{name} runs float16/bfloat16 only, not {q.dtype}; use the sdpa backend for {q.dtype}")


def _backward_inputs(q, k, v, dout, out, multiple: int = 1):
    """q, k, v, dout, out zero-padded to the head dim the kernel ran with (_pad_head_dims)."""
    qf, kf, vf = _pad_head_dims(q, k, v, multiple)
    d = qf.shape[-1]
    dout_f, out_f = (x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1])) for x in (dout, out))
    return qf, kf, vf, dout_f, out_f


def _pad_head_dims(q, k, v, multiple: int = 1):
    """q, k, v zero-padded to one head dim (a multiple of `multiple`); v's own dim to crop to.
    Zero columns change no score and give zero output columns (zorro_core.attention.head_dims)."""
    d = max(q.shape[-1], v.shape[-1])
    d = -(-d // multiple) * multiple
    q, k, v = (x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1])) for x in (q, k, v))
    return q, k, v


class KernelPair:
    """A varlen kernel's forward (returning the lse) and backward (taking it). See the module docstring."""

    name: str = ""

    def forward(
        self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool, scale: float, cache: Optional[dict] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`cache`: a dict that lives as long as these cu_seqlens (one per call of a plan), where a
        pair may keep index math it derives from them for the next layer."""
        raise NotImplementedError

    def backward(
        self,
        dout,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q: int,
        max_k: int,
        causal: bool,
        scale: float,
        cache: Optional[dict] = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def unavailable(self, device: torch.device) -> Optional[str]:
        """Why the pair cannot run on `device` here, or None."""
        return None


def _buckets(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[torch.Tensor]:
    """The segments with queries, grouped so that lengths within a group differ by less than 2x
    (by the power of two above each query and key length): padding a group to its longest then
    wastes at most 2x per dimension, where one padded batch of a long prompt and short responses
    would pad every response to the prompt."""
    cq, ck = cu_q.long(), cu_k.long()
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    keep = (lq > 0).nonzero().flatten()
    if keep.numel() == 0:
        return []
    bits = lambda x: torch.ceil(torch.log2(x.clamp(min=1).double())).long()  # noqa: E731
    key = bits(lq[keep]) * 64 + bits(lk[keep])
    return [keep[key == k] for k in torch.unique(key).tolist()]


class _Padding:
    """The padded batch of some segments of one call (`segments`, indices of segments with
    queries): slot indices, built per call (cheap index math next to the kernel)."""

    def __init__(self, cu_q: torch.Tensor, cu_k: torch.Tensor, segments: torch.Tensor) -> None:
        device = segments.device
        cq, ck = cu_q.to(device).long(), cu_k.to(device).long()
        lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        keep = segments
        self.lq, self.lk = lq[keep], lk[keep]
        self.n = keep.numel()
        self.len_q = int(self.lq.max())
        self.len_k = int(self.lk.max())
        aq = torch.arange(self.len_q, device=device)
        ak = torch.arange(self.len_k, device=device)
        self.valid_q = aq[None, :] < self.lq[:, None]
        self.valid_k = ak[None, :] < self.lk[:, None]
        self.rows_q = (cq[:-1][keep][:, None] + aq[None, :])[self.valid_q]
        self.rows_k = (ck[:-1][keep][:, None] + ak[None, :])[self.valid_k]
        self.slots_q = self.valid_q.flatten().nonzero().flatten()
        self.slots_k = self.valid_k.flatten().nonzero().flatten()
        self.ragged_k = bool((self.lk != self.len_k).any())
        # Every segment full and the segments adjacent: the padded batch is a view of the rows.
        self.view_q = self._first_if_dense(self.rows_q, self.n * self.len_q)
        self.view_k = self._first_if_dense(self.rows_k, self.n * self.len_k)

    @staticmethod
    def _first_if_dense(rows: torch.Tensor, slots: int) -> Optional[int]:
        """The first row when `rows` is rows[0] .. rows[0] + slots - 1 (no padding, no gap), else None."""
        if rows.numel() != slots or slots == 0:
            return None
        first = int(rows[0])
        return first if int(rows[-1]) - first == slots - 1 else None

    def pad_q(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[Tq, H, D] -> [n, H, Lq, D]; padding slots hold `fill` (finite: a padding slot still
        enters the kernel's products)."""
        return self._pad(x, self.rows_q, self.slots_q, self.len_q, fill, self.view_q)

    def pad_k(self, x: torch.Tensor) -> torch.Tensor:
        return self._pad(x, self.rows_k, self.slots_k, self.len_k, 0.0, self.view_k)

    def _pad(self, x, rows, slots, length, fill, first):
        if first is not None:
            return x[first : first + self.n * length].view(self.n, length, *x.shape[1:]).transpose(1, 2)
        buf = x.new_full((self.n * length, *x.shape[1:]), fill)
        buf.index_copy_(0, slots, x.index_select(0, rows))
        return buf.view(self.n, length, *x.shape[1:]).transpose(1, 2)

    def unpad_q(self, xp: torch.Tensor, into: torch.Tensor) -> None:
        """[n, H, Lq, D] -> the real query rows of `into` [Tq, H, D]."""
        self._unpad(xp, self.rows_q, self.slots_q, into)

    def unpad_k(self, xp: torch.Tensor, into: torch.Tensor) -> None:
        self._unpad(xp, self.rows_k, self.slots_k, into)

    def _unpad(self, xp, rows, slots, into):
        flat = xp.transpose(1, 2).reshape(-1, xp.shape[1], xp.shape[-1])
        if rows.numel() == flat.shape[0] and (first := self._first_if_dense(rows, rows.numel())) is not None:
            into[first : first + rows.numel()] = flat
            return
        into.index_copy_(0, rows, flat.index_select(0, slots).to(into.dtype))

    def mask(self, causal: bool, dtype: torch.dtype) -> tuple[Optional[torch.Tensor], bool]:
        """(additive mask or None, is_causal) for the kernel: self-causal segments of equal query and
        key lengths use top-left `is_causal` (exact for real queries, padding after them); other
        causal segments (fewer queries than keys) get their bottom-right pairs as a mask; the rest a
        mask on the padding keys of shorter segments, or none."""
        dev = self.valid_k.device
        if causal and bool((self.lq == self.lk).all()):
            return None, True
        if not causal and not self.ragged_k:
            return None, False
        allowed = self.valid_k[:, None, :].expand(self.n, self.len_q, self.len_k)
        if causal:
            aq = torch.arange(self.len_q, device=dev)
            ak = torch.arange(self.len_k, device=dev)
            allowed = allowed & (ak[None, None, :] <= (aq[None, :] + self.lk[:, None] - self.lq[:, None])[..., None])
            # a padding query would see no key (a NaN row): let it see key 0; its output is dropped
            allowed = allowed | (~self.valid_q[:, :, None] & (ak[None, None, :] == 0))
        mask = torch.zeros(self.n, 1, self.len_q if causal else 1, self.len_k, dtype=dtype, device=dev)
        return mask.masked_fill_(~(allowed if causal else self.valid_k[:, None, :])[:, None], float("-inf")), False


def _paddings(cu_q: torch.Tensor, cu_k: torch.Tensor, device: torch.device, cache: Optional[dict]) -> list[_Padding]:
    """The padded layouts of a call's length classes, from `cache` when the call has one (every layer
    and the backward reuse them)."""
    key = ("cpu_paddings", device)
    if cache is not None and key in cache:
        return cache[key]
    cq, ck = cu_q.to(device), cu_k.to(device)
    pads = [_Padding(cq, ck, segments) for segments in _buckets(cq, ck)]
    if cache is not None:
        cache[key] = pads
    return pads


@functools.lru_cache(maxsize=None)
def cpu_flash_gqa() -> bool:
    """Whether torch's CPU flash kernel takes fewer K/V heads than query heads (forward and
    backward), checked once on a tiny case against the heads repeated; otherwise they are repeated."""
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            g = torch.Generator().manual_seed(0)
            q, gr = (torch.randn(1, 4, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
            fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
            o, lse = fwd(q, k, v, 0.0, True, scale=0.3)
            grads = bwd(gr, q, k, v, o, lse, 0.0, True, scale=0.3)
            kr, vr = _repeat_heads(k, 2), _repeat_heads(v, 2)
            o2, lse2 = fwd(q, kr, vr, 0.0, True, scale=0.3)
            dq2, dk2, dv2 = bwd(gr, q, kr, vr, o2, lse2, 0.0, True, scale=0.3)
            want = (o2, dq2, _fold_heads(dk2, 2), _fold_heads(dv2, 2))
            return all(a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-12)) for a, b in zip((o, *grads), want))
    except Exception:  # noqa: BLE001 - any failure means "repeat the heads"
        return False


def _repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[n, Hkv, L, D] -> [n, Hkv * rep, L, D], each K/V head serving `rep` query heads (GQA)."""
    if rep == 1:
        return x
    n, h, length, d = x.shape
    return x[:, :, None].expand(n, h, rep, length, d).reshape(n, h * rep, length, d)


def _fold_heads(dx: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of _repeat_heads: sum each K/V head's `rep` copies."""
    if rep == 1:
        return dx
    n, h, length, d = dx.shape
    return dx.view(n, h // rep, rep, length, d).sum(2)


class CpuFlashPair(KernelPair):
    """torch's CPU flash kernel over a padded batch built and dropped inside each call.

    The kernel takes [n, H, L, D] with one head dim and equal head counts: segments are padded to
    the longest of their length class (_buckets, one kernel call each), K/V heads repeated for GQA and head dims zero-padded for MLA, all transients of the
    call. Causal segments are padded at their end, where top-left `is_causal` is exact for the real
    queries; ragged key segments get an additive mask on their padding keys. In backward the
    padding queries get an lse of +inf, so their probabilities are exactly 0."""

    name = "flash_cpu"

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, cache=None):
        tq, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
        qf, kf, vf = _pad_head_dims(q, k, v)
        rep = 1 if cpu_flash_gqa() else hq // k.shape[1]
        out = q.new_zeros(tq, hq, qf.shape[-1])
        lse = torch.full((tq, hq, 1), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        for pad in _paddings(cu_q, cu_k, q.device, cache):
            qp = pad.pad_q(qf)
            kp, vp = _repeat_heads(pad.pad_k(kf), rep), _repeat_heads(pad.pad_k(vf), rep)
            mask, top_left = pad.mask(causal, q.dtype)
            out_p, lse_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qp, kp, vp, 0.0, top_left, attn_mask=mask, scale=scale
            )
            pad.unpad_q(out_p, out)
            pad.unpad_q(lse_p[..., None], lse)
        # MLA (Dv < Dq): the output is saved for backward, so not as a view of the padded buffer
        return out[..., :dv].contiguous(), lse[..., 0].T.contiguous()

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, cache=None):
        hq, dq_dim, dv = q.shape[1], q.shape[-1], v.shape[-1]
        qf, kf, vf, dout_f, out_f = _backward_inputs(q, k, v, dout, out)
        rep = 1 if cpu_flash_gqa() else hq // k.shape[1]
        dq, dk, dvv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        for pad in _paddings(cu_q, cu_k, q.device, cache):
            qp, op, gp = pad.pad_q(qf), pad.pad_q(out_f), pad.pad_q(dout_f)
            kp, vp = _repeat_heads(pad.pad_k(kf), rep), _repeat_heads(pad.pad_k(vf), rep)
            # The kernel keeps the lse as float32 (float64 for float64 inputs), [n, H, Lq]; padding
            # queries get +inf, so their probabilities are exactly 0.
            lse_p = pad.pad_q(lse.T[..., None], fill=float("inf"))[..., 0]
            mask, top_left = pad.mask(causal, q.dtype)
            dq_p, dk_p, dv_p = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                gp.contiguous(), qp, kp, vp, op, lse_p.contiguous(), 0.0, top_left, attn_mask=mask, scale=scale
            )
            pad.unpad_q(dq_p, dq)
            pad.unpad_k(_fold_heads(dk_p, rep), dk)
            pad.unpad_k(_fold_heads(dv_p, rep), dvv)
        return dq[..., :dq_dim], dk[..., :dq_dim], dvv[..., :dv]

    def unavailable(self, device):
        if device.type != "cpu":
            return f"flash_cpu runs on the CPU (got {device.type}); on CUDA use torch_varlen or flash_attn"
        return None


def _schema_names(op: Any) -> set[str]:
    return {a.name for a in op.default._schema.arguments}


class TorchFlashPair(KernelPair):
    """`aten._flash_attention_forward/_backward` on cu_seqlens (CUDA): the ops torch's varlen_attn
    runs, called directly so the lse comes back and the backward takes the merged one. GQA and
    MLA are handled as for flash_cpu, inside the call."""

    name = "torch_varlen"
    FORWARD_ARGS = ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal")
    BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k")

    def __init__(self, ops: Optional[Any] = None) -> None:
        self._ops = ops
        """Where the two ops are looked up (torch.ops.aten; a stand-in in tests)."""

    @property
    def ops(self) -> Any:
        return self._ops if self._ops is not None else torch.ops.aten

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, cache=None):
        check_half(q, self.name)
        dv = v.shape[-1]
        qf, kf, vf = _pad_head_dims(q, k, v, multiple=8)
        # (output, softmax_logsumexp, rng_state, unused, debug_attn_mask), torch 2.4 to 2.15
        out, lse = self.ops._flash_attention_forward(
            qf, kf, vf, cu_q, cu_k, kernel_max_q(max_q), max_k, 0.0, causal, False, scale=scale
        )[:2]
        return out[..., :dv], checked_lse(lse, q, "aten._flash_attention_forward")

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, cache=None):
        dq_dim, dv = q.shape[-1], v.shape[-1]
        qf, kf, vf, dout_f, out_f = _backward_inputs(q, k, v, dout, out, multiple=8)
        unused = torch.empty(0, device=q.device)
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the rng state is unread
        dq, dk, dvv = self.ops._flash_attention_backward(
            dout_f.contiguous(),
            qf,
            kf,
            vf,
            out_f,
            kernel_lse(lse, q, self.name),
            cu_q,
            cu_k,
            kernel_max_q(max_q),
            max_k,
            0.0,
            causal,
            seed,
            unused,
            scale=scale,
        )
        return dq[..., :dq_dim], dk[..., :dq_dim], dvv[..., :dv]

    def unavailable(self, device):
        why = cuda_pair_refusal(self.name, device)
        if why:
            return why
        for op, names in (
            ("_flash_attention_forward", self.FORWARD_ARGS),
            ("_flash_attention_backward", self.BACKWARD_ARGS),
        ):
            have = _schema_names(getattr(self.ops, op))
            missing = [n for n in (*names, "scale") if n not in have]
            if missing:
                return f"torch {torch.__version__}: aten.{op} has no argument(s) {missing}"
        return None


FLASH_ATTN_MIN = (2, 6)
FLASH_ATTN_MAX = (2, 8)
"""The flash-attn minors whose varlen pair zorro calls (each one's arguments and return tuple are
spelt out below; CI runs each one's own interface over a CPU emulation of its kernel)."""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def flash_attn_window_kwargs(version: tuple[int, ...]) -> dict[str, Any]:
    """No window, in the spelling of flash-attn `version`'s private pair (a tuple until 2.6, two ints from 2.7)."""
    return {"window_size": (-1, -1)} if version[:2] < (2, 7) else {"window_size_left": -1, "window_size_right": -1}


class FlashAttnPair(KernelPair):
    """flash-attn 2's `_flash_attn_varlen_forward/_backward` (CUDA; GQA native, MLA padded).

    Called by keyword, per release, never by introspection: from 2.7 (with torch >= 2.4) both are
    torch.library custom ops, whose signature reads (*args, **kwargs) and which have no __name__."""

    name = "flash_attn"

    def __init__(self, interface: Optional[Any] = None, version: Optional[str] = None) -> None:
        self._interface = interface
        """The module holding the pair (flash_attn.flash_attn_interface; an emulated one in tests)."""
        self._version = version
        """Its flash-attn release (default: the installed package's)."""

    @property
    def interface(self) -> Any:
        if self._interface is not None:
            return self._interface
        # lazy, and looked up per call (a dict hit): flash-attn is optional (unavailable() checks it first)
        return importlib.import_module("flash_attn.flash_attn_interface")

    def version(self) -> tuple[int, ...]:
        """The release whose calling convention is used (refused outside 2.6-2.8)."""
        text = self._version if self._version is not None else flash_attn_version()
        v = _version_tuple(text)
        if not FLASH_ATTN_MIN <= v[:2] <= FLASH_ATTN_MAX:
            raise RuntimeError(flash_attn_version_refusal(text))
        return v

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, cache=None):
        check_half(q, self.name)
        version = self.version()
        dv = v.shape[-1]
        qf, kf, vf = _pad_head_dims(q, k, v, multiple=8)
        res = self.interface._flash_attn_varlen_forward(
            q=qf,
            k=kf,
            v=vf,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=kernel_max_q(max_q),
            max_seqlen_k=max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
        )
        # 2.6: (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state); 2.7+: (out, softmax_lse, S_dmask, rng_state)
        out, lse = (res[0], res[5]) if version[:2] < (2, 7) else (res[0], res[1])
        return out[..., :dv], checked_lse(lse, q, f"flash-attn {'.'.join(map(str, version))}")

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, cache=None):
        version = self.version()
        dq_dim, dv = q.shape[-1], v.shape[-1]
        qf, kf, vf, dout_f, out_f = _backward_inputs(q, k, v, dout, out, multiple=8)
        dq, dk, dvv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        self.interface._flash_attn_varlen_backward(  # writes dq, dk, dv
            dout=dout_f.contiguous(),
            q=qf,
            k=kf,
            v=vf,
            out=out_f,
            softmax_lse=kernel_lse(lse, q, self.name),
            dq=dq,
            dk=dk,
            dv=dvv,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=kernel_max_q(max_q),
            max_seqlen_k=max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=None,
            **flash_attn_window_kwargs(version),
        )
        return dq[..., :dq_dim], dk[..., :dq_dim], dvv[..., :dv]

    def unavailable(self, device):
        why = cuda_pair_refusal(self.name, device)
        if why:
            return why
        if self._interface is not None:
            return None
        return flash_attn_missing()


def flash_attn_version() -> str:
    """The flash-attn release importable here (its package's __version__, else its metadata)."""
    try:
        return str(importlib.import_module("flash_attn").__version__)
    except (ImportError, AttributeError):
        try:
            return importlib.metadata.version("flash-attn")
        except importlib.metadata.PackageNotFoundError:
            return "0"


def flash_attn_version_refusal(version: str) -> Optional[str]:
    """Why flash-attn `version`'s varlen pair is not one zorro calls, or None."""
    v = _version_tuple(version)[:2]
    lo, hi = ".".join(map(str, FLASH_ATTN_MIN)), ".".join(map(str, FLASH_ATTN_MAX))
    if v < FLASH_ATTN_MIN:
        return f"flash-attn {version} is older than {lo} (its varlen lse layout differs)"
    if v > FLASH_ATTN_MAX:
        return f"flash-attn {version} is newer than the releases zorro's varlen pair is written for ({lo} to {hi}.x)"
    return None


@functools.lru_cache(maxsize=None)
def flash_attn_missing() -> Optional[str]:
    """Why flash-attn's varlen pair is not usable here, or None."""
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed (pip install 'zorro[gpu]')"
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    return flash_attn_version_refusal(version)
