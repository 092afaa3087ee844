"""The varlen flash kernels' compiled part on CPU, with their memory contract (tests only).

flash-attn 2's `mha_varlen_fwd` / `mha_varlen_bwd` (csrc/flash_attn/flash_api.cpp, 2.6.3 to
2.8.3.post2) and PyTorch's vendored copy under `aten._flash_attention_forward/_backward` behave
like this, and so does this module:
- the C++ TORCH_CHECKs: fp16/bf16 only and one dtype, int32 contiguous cu_seqlens on q's device,
  last dimension contiguous (stride 1) for q, k, v, out, dout and dq, dk, dv, head dim <= 256 and a
  multiple of 8 where the release checks it, Hq a multiple of Hkv, the shapes;
- q, k, v, out, dout are read through their row and head strides (any, last dim contiguous);
- the lse handed to the backward is read from its data pointer as a dense [H, total_q] float32 block,
  its strides ignored (flash_bwd_kernel.h: `row_offset_lse = bidh * params.total_q + ...`); only its
  device is checked;
- dq, dk, dv are written into the buffers given, in place (through their strides);
- a row that sees no key gets output 0 and lse +inf (the kernels' early exit, and the seqlen_k == 0 case);
- the forward takes the decode shortcut (`seqlenq_ngroups_swapped`) exactly when the C++ does,
  including its reshape of q to [batch, Hkv, ngroups, D], which fails when total_q != batch.
The math is flash's, in float32: S = q k^T scale, lse = logsumexp(S), out = exp(S - lse) v; backward
P = exp(S - lse), D = rowsum(dout * out), dS = P (dout v^T - D), dq = dS k scale, dk = dS^T q scale,
dv = P^T dout, dk/dv summed over each K/V head's query heads (GQA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

HALF = (torch.float16, torch.bfloat16)


@dataclass
class Calls:
    """What an emulated kernel saw, for the tests to assert it really ran: forward calls, and each
    one's window (left, right) as the C++ receives it, causal folded in (right = 0)."""

    n: int = 0
    windows: list = field(default_factory=list)

    def record(self, left: int, right: int, causal: bool) -> None:
        self.n += 1
        self.windows.append((left, 0 if causal else right))


class TorchCheckError(RuntimeError):
    """A TORCH_CHECK of the kernel's C++ failed (the compiled kernel raises RuntimeError too)."""


def check(cond: bool, what: str) -> None:
    if not cond:
        raise TorchCheckError(what)


def _check_cu(cu: torch.Tensor, name: str, q: torch.Tensor, batch: int) -> None:
    check(cu.dtype == torch.int32, f"{name} must have dtype int32")
    check(cu.device == q.device, f"{name} must be on the same device as q")
    check(cu.is_contiguous(), f"{name} must be contiguous")
    check(tuple(cu.shape) == (batch + 1,), f"{name} must have shape ({batch + 1},)")


def _segments(
    cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, total_q: int, total_k: int
) -> list[tuple[int, int, int, int]]:
    """(q0, q1, k0, k1) per segment. The kernel sizes its grid by max_seqlen_q/k: a segment longer
    would leave rows unwritten on the GPU, and offsets past the tensors would read out of bounds;
    the C++ checks neither, this emulation refuses both rather than guess."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    check(cq[0] == 0 and cq[-1] <= total_q, f"emulation: cu_seqlens_q {cq} runs past the {total_q} query rows")
    check(ck[0] == 0 and ck[-1] <= total_k, f"emulation: cu_seqlens_k {ck} runs past the {total_k} key rows")
    segs = []
    for i in range(len(cq) - 1):
        lq, lk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        check(0 <= lq <= max_q, f"emulation: segment {i} has {lq} queries, max_seqlen_q is {max_q}")
        check(0 <= lk <= max_k, f"emulation: segment {i} has {lk} keys, max_seqlen_k is {max_k}")
        segs.append((cq[i], cq[i + 1], ck[i], ck[i + 1]))
    return segs


def _allowed(lq: int, lk: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """[lq, lk] visibility, bottom-right aligned (query i sits at key position i + lk - lq)."""
    pos = torch.arange(lq)[:, None] + (lk - lq)
    key = torch.arange(lk)[None, :]
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if causal:
        right = 0
    if right >= 0:
        ok &= key <= pos + right
    if left >= 0:
        ok &= key >= pos - left
    return ok


def check_qkv(q, k, v, head_multiple_of_8: bool) -> None:
    check(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
    check(k.dtype == q.dtype, "query and key must have the same dtype")
    check(v.dtype == q.dtype, "query and value must have the same dtype")
    for x in (k, v):
        check(x.device == q.device, "Tensor must be on CUDA device")
    for x in (q, k, v):
        check(x.dim() == 3, "q, k, v must be [total, heads, head_size]")
        check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    d = q.shape[2]
    check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    if head_multiple_of_8:
        check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    check(q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    check(tuple(k.shape) == (k.shape[0], k.shape[1], d), "k must have shape (total_k, num_heads_k, head_size)")
    check(tuple(v.shape) == tuple(k.shape), "v must have shape (total_k, num_heads_k, head_size)")


def varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    dropout_p: float,
    scale: float,
    causal: bool,
    left: int,
    right: int,
    head_multiple_of_8: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mha_varlen_fwd without paging, alibi, softcap or dropout: (out [Tq, Hq, D] in q's dtype,
    lse [Hq, Tq] float32, dense)."""
    check_qkv(q, k, v, head_multiple_of_8)
    batch = cu_q.numel() - 1
    _check_cu(cu_q, "cu_seqlens_q", q, batch)
    _check_cu(cu_k, "cu_seqlens_k", q, batch)
    check(batch > 0, "batch size must be positive")
    check(dropout_p == 0.0, "emulation: dropout is not emulated")
    hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
    if max_q == 1:
        causal = False  # the C++: "causal=true is the same as causal=false in this case"
    if causal:
        right = 0
    swapped = max_q == 1 and hq > hk and left < 0 and right < 0 and dropout_p == 0.0 and d % 8 == 0
    if swapped:
        # The C++'s decode shortcut, as written: it assumes one query per segment (total_q == batch).
        ngroups = hq // hk
        q = q.reshape(batch, hk, ngroups, d).transpose(1, 2).reshape(batch * ngroups, hk, d)
        q = q.reshape(batch, ngroups, hk, d).transpose(1, 2).reshape(batch, hq, d)  # its output reshape back
    if left >= max_k:
        left = -1
    if right >= max_k:
        right = -1
    tq = q.shape[0]
    out = torch.zeros(tq, hq, d, dtype=torch.float32)
    lse = torch.full((hq, tq), float("inf"), dtype=torch.float32)  # no key: +inf
    rep = hq // hk
    for q0, q1, k0, k1 in _segments(cu_q, cu_k, max_q, max_k, tq, k.shape[0]):
        if q1 == q0 or k1 == k0:
            continue
        qi = q[q0:q1].float().transpose(0, 1)  # [H, lq, D], read through q's strides
        ki = k[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        vi = v[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        s = (qi @ ki.transpose(-1, -2)) * scale
        ok = _allowed(q1 - q0, k1 - k0, causal, left, right)
        s = s.masked_fill(~ok, float("-inf"))
        m = torch.logsumexp(s, -1)  # [H, lq], -inf where no key
        seen = ok.any(-1)
        p = torch.exp(s - m.masked_fill(~seen, 0.0)[..., None])
        out[q0:q1] = (p @ vi).transpose(0, 1)
        lse[:, q0:q1] = m.masked_fill(~seen, float("inf"))
    return out.to(q.dtype), lse


def dense_lse(lse: torch.Tensor, h: int, total_q: int) -> torch.Tensor:
    """The lse as the CUDA backward reads it: [h, total_q] float32 from its data pointer, its own
    strides ignored (what it actually holds there is whatever the storage holds)."""
    check(lse.dtype == torch.float32, "emulation: the kernel reads the lse as float32")
    need = lse.storage_offset() + h * total_q
    have = lse.untyped_storage().nbytes() // lse.element_size()
    check(need <= have, f"emulation: the kernel would read the lse past its storage ({need} > {have} floats)")
    return torch.as_strided(lse, (h, total_q), (total_q, 1), lse.storage_offset())


def _check_grad_buffer(buf: Optional[torch.Tensor], like: torch.Tensor, name: str) -> None:
    if buf is None:
        return
    check(buf.dtype == like.dtype, f"{name} must have the same dtype as q")
    check(buf.device == like.device, f"{name} must be on CUDA device")
    check(buf.stride(-1) == 1, f"{name} must have contiguous last dimension")
    check(tuple(buf.shape) == tuple(like.shape), f"{name} must have shape {tuple(like.shape)}")


def varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    dropout_p: float,
    scale: float,
    causal: bool,
    left: int,
    right: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mha_varlen_bwd: (dq, dk, dv, softmax_d), dq/dk/dv written into the given buffers when given."""
    check(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
    for name, x in (("key", k), ("value", v), ("out", out), ("dout", dout)):
        check(x.dtype == q.dtype, f"query and {name} must have the same dtype")
    for x in (k, v, out, dout, lse, cu_q, cu_k):
        check(x.device == q.device, "Tensor must be on CUDA device")
    for name, x in (("Input", q), ("Input", k), ("Input", v), ("out", out), ("dout", dout)):
        check(x.stride(-1) == 1, f"{name} tensor must have contiguous last dimension")
    batch = cu_q.numel() - 1
    _check_cu(cu_q, "cu_seqlens_q", q, batch)
    _check_cu(cu_k, "cu_seqlens_k", q, batch)
    check(batch > 0, "batch size must be positive")
    tq, hq, d = q.shape
    tk, hk = k.shape[0], k.shape[1]
    check(d % 8 == 0, "head_size should be a multiple of 8")
    check(d <= 256, "FlashAttention backward only supports head dimension at most 256")
    check(hq % hk == 0, "Number of heads in key/value must divide number of heads in query")
    check(
        tuple(k.shape) == (tk, hk, d) and tuple(v.shape) == (tk, hk, d),
        "k, v must be (total_k, num_heads_k, head_size)",
    )
    check(tuple(out.shape) == (tq, hq, d), "out must have shape (total_q, num_heads, head_size)")
    check(tuple(dout.shape) == (tq, hq, d), "dout must have shape (total_q, num_heads, head_size)")
    check(dropout_p == 0.0, "emulation: dropout is not emulated")
    for name, buf, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check_grad_buffer(buf, like, name)
    if causal:
        right = 0
    if left >= max_k:
        left = -1
    if right >= max_k:
        right = -1
    lse_d = dense_lse(lse, hq, tq)  # strides ignored, as the kernel does
    rep = hq // hk
    gq = torch.zeros(tq, hq, d, dtype=torch.float32)
    gk = torch.zeros(tk, hq, d, dtype=torch.float32)
    gv = torch.zeros(tk, hq, d, dtype=torch.float32)
    softmax_d = torch.zeros(hq, tq, dtype=torch.float32)
    for q0, q1, k0, k1 in _segments(cu_q, cu_k, max_q, max_k, tq, tk):
        if q1 == q0 or k1 == k0:
            continue  # the kernel writes dk = dv = 0 for key blocks no query reaches
        qi = q[q0:q1].float().transpose(0, 1)
        ki = k[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        vi = v[k0:k1].float().repeat_interleave(rep, dim=1).transpose(0, 1)
        do = dout[q0:q1].float().transpose(0, 1)
        oi = out[q0:q1].float().transpose(0, 1)
        s = (qi @ ki.transpose(-1, -2)) * scale
        s = s.masked_fill(~_allowed(q1 - q0, k1 - k0, causal, left, right), float("-inf"))
        p = torch.exp(s - lse_d[:, q0:q1, None])  # lse +inf: p = 0
        dsum = (do * oi).sum(-1)
        softmax_d[:, q0:q1] = dsum
        ds = p * (do @ vi.transpose(-1, -2) - dsum[..., None])
        gq[q0:q1] = (ds @ ki * scale).transpose(0, 1)
        gk[k0:k1] = (ds.transpose(-1, -2) @ qi * scale).transpose(0, 1)
        gv[k0:k1] = (p.transpose(-1, -2) @ do).transpose(0, 1)
    gk = gk.view(tk, hk, rep, d).sum(2)
    gv = gv.view(tk, hk, rep, d).sum(2)
    dq = dq if dq is not None else torch.empty_like(q)
    dk = dk if dk is not None else torch.empty_like(k)
    dv = dv if dv is not None else torch.empty_like(v)
    dq.copy_(gq)  # in place, through the buffers' strides
    dk.copy_(gk)
    dv.copy_(gv)
    return dq, dk, dv, softmax_d
