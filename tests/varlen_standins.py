"""Installing the GPU kernels zorro calls, so their glue runs end to end on CPU (tests only).

- flash-attn and torch's varlen attention are not stood in for: `install_flash_attn` and
  `install_torch_varlen` are thin wrappers over the kernels' CPU emulation (tests/kernel_emulation),
  which runs flash-attn's own `flash_attn_interface` (a release from its sdist) and torch's own
  `varlen_attn` and aten op calls over an emulation of the compiled part that keeps its memory
  contract and makes its C++ checks (refusals raise RuntimeError, as the compiled kernels do).
- fla's `chunk_gated_delta_rule` with `cu_seqlens` (flash-linear-attention 0.2+) is a contract
  stand-in: q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV] (batch 1 when cu_seqlens is
  given), HV a multiple of H; cu_seqlens a LongTensor on q's device from 0 to T; initial_state
  [N, HV, K, V] with N the number of sequences; returns (o [1, T, HV, V], final_state [N, HV, K, V]
  in float32 or None). Computed per sequence with tests/delta_rule.py's chunk_gated_delta_rule_exact
  (each sequence chunked from its own start, as fla does); it refuses what fla refuses (ContractError).
"""

from __future__ import annotations

import inspect
import sys
from typing import Optional

import torch

from tests.kernel_emulation.flash_core import Calls
from zorro_core.verify.delta_rule import chunk_gated_delta_rule_exact

__all__ = [
    "Calls",
    "ContractError",
    "chunk_gated_delta_rule",
    "install_fla",
    "install_flash_attn",
    "install_torch_varlen",
]

HALF = (torch.float16, torch.bfloat16)


class ContractError(AssertionError):
    """A call the real kernel would refuse or compute wrong."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ContractError(what)


def _check_cu(cu, name: str, total: int, max_len, device, dtype) -> torch.Tensor:
    _require(
        isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() >= 2,
        f"{name} must be a 1-D tensor of n+1 offsets",
    )
    _require(cu.dtype == dtype, f"{name} must be {dtype}, got {cu.dtype}")
    _require(cu.device == device, f"{name} must be on the queries' device {device}, got {cu.device}")
    _require(
        int(cu[0]) == 0 and int(cu[-1]) == total, f"{name} must run from 0 to {total}, got {int(cu[0])}..{int(cu[-1])}"
    )
    lens = cu[1:] - cu[:-1]
    _require(bool((lens >= 0).all()), f"{name} must be non-decreasing")
    if max_len is not None:
        _require(type(max_len) is int, f"the max length for {name} must be a Python int, got {type(max_len).__name__}")
        _require(
            max_len >= int(lens.max()), f"max length {max_len} is below the longest segment {int(lens.max())} of {name}"
        )
    return cu.long()


def _record(calls: Optional[Calls], window: Optional[tuple[int, int]] = None) -> None:
    if calls is not None:
        calls.n += 1
        if window is not None:
            calls.windows.append(window)


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    head_first=False,
    use_qk_l2norm_in_kernel=False,
    *,
    calls: Optional[Calls] = None,
):
    _require(not head_first, "head_first=True is not the layout transformers passes")
    _require(
        q.dim() == k.dim() == v.dim() == 4 and g.dim() == beta.dim() == 3, "q, k, v [B, T, H, D]; g, beta [B, T, HV]"
    )
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    _require(
        k.shape == q.shape and v.shape[:2] == (b, t) and g.shape == beta.shape == (b, t, hv),
        f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}",
    )
    _require(hv % h == 0, f"value heads {hv} must be a multiple of key heads {h}")
    _require(q.dtype == k.dtype == v.dtype, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        _require(x.device == q.device, f"{name} is on {x.device}, q on {q.device}")
    if cu_seqlens is None:
        n, bounds = b, None
    else:
        _require(b == 1, f"the batch size must be 1 with cu_seqlens, got {b}")
        cu = _check_cu(cu_seqlens, "cu_seqlens", t, None, q.device, torch.int64)
        n, bounds = cu.numel() - 1, cu.tolist()
    if initial_state is not None:
        _require(
            tuple(initial_state.shape) == (n, hv, dk, dv),
            f"initial_state must be [{n}, {hv}, {dk}, {dv}] (one per sequence), got {tuple(initial_state.shape)}",
        )
        _require(initial_state.device == q.device, "initial_state must be on q's device")
    _record(calls)
    if scale is not None:
        _require(abs(scale - dk**-0.5) < 1e-12, "the stand-in (delta_rule.py) uses scale = K ** -0.5 only")
    outs, states = [], []
    for i in range(n):
        s, e = (bounds[i], bounds[i + 1]) if bounds is not None else (0, t)
        row = slice(0, 1) if bounds is not None else slice(i, i + 1)
        init = initial_state[i : i + 1] if initial_state is not None else None
        o, st = chunk_gated_delta_rule_exact(
            q[row, s:e],
            k[row, s:e],
            v[row, s:e],
            g[row, s:e],
            beta[row, s:e],
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        outs.append(o)
        states.append(st)
    out = torch.cat(outs, dim=1 if bounds is not None else 0)
    final = torch.cat(states) if output_final_state else None
    if final is not None and final.dtype != torch.float64:
        final = final.float()  # fla returns float32 states
    return out, final


# ---------------------------------------------------------------- installing them


def install_flash_attn(emulation, monkeypatch, calls: Calls, version: Optional[str] = None) -> None:
    """flash-attn's real interface at `version` (default: the newest zorro supports) over the CPU
    kernel (`emulation`: the kernel_emulation fixture), and the flash_attn backend allowed on CPU."""
    from tests.kernel_emulation.releases import LATEST
    from zorro_core.attention import backends
    from zorro_core.attention.kernels import FlashAttnPair

    interface = emulation.flash_attn(version or LATEST, calls)
    monkeypatch.setattr(backends.BACKENDS["flash_attn"], "pair", FlashAttnPair(interface, version or LATEST))
    _allow_on_cpu(monkeypatch, "flash_attn")


def install_torch_varlen(emulation, monkeypatch, calls: Calls, enable_gqa_kwarg: bool = True) -> None:
    """torch's aten flash ops on CPU (`emulation`: the kernel_emulation fixture), under torch's own
    varlen_attn (2.13) or, with enable_gqa_kwarg=False, that varlen_attn behind torch 2.11's
    signature (no enable_gqa: then GQA needs K/V expanded to the query heads)."""
    import torch.nn.attention.varlen as varlen

    from zorro_core.attention import backends

    emulation.aten(calls)
    if not enable_gqa_kwarg:
        # torch 2.11's varlen_attn ends at window_size: it has none of these keywords
        dropped = ("enable_gqa", "seqused_k", "block_table", "num_splits")
        real = varlen.varlen_attn
        sig = inspect.signature(real)
        sig = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in dropped])

        def varlen_attn(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)  # TypeError for an argument 2.11 lacks
            return real(*bound.args, **bound.kwargs)

        varlen_attn.__signature__ = sig  # type: ignore[attr-defined]
        monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)
        # zorro reads the signature to pick the GQA path (cached per process): read this one
        monkeypatch.setattr(backends, "_varlen_attn_takes", lambda name: name in sig.parameters)
    _allow_on_cpu(monkeypatch, "torch_varlen")


def _allow_on_cpu(monkeypatch, name: str) -> None:
    from zorro_core.attention import backends

    monkeypatch.setattr(backends.BACKENDS[name], "unavailable", lambda device: None)


def install_fla(monkeypatch, calls: Calls) -> None:
    """Qwen3-Next's delta rule resolved to (the stand-in of) fla, and the adapter's fla path taken on CPU."""
    from zorro_core.models import linear_attention

    qwen3_next = sys.modules["transformers.models.qwen3_next.modeling_qwen3_next"]
    monkeypatch.setattr(
        qwen3_next,
        "torch_chunk_gated_delta_rule",
        lambda *a, **kw: chunk_gated_delta_rule(*a, calls=calls, **_fla_kwargs(kw)),
    )
    monkeypatch.setattr(linear_attention, "fla_serves", lambda x: True)


_FLA_PARAMS = {
    "scale",
    "initial_state",
    "output_final_state",
    "cu_seqlens",
    "head_first",
    "use_qk_l2norm_in_kernel",
    "g",
    "beta",
}


def _fla_kwargs(kwargs: dict) -> dict:
    # What transformers' kernel wrapper does: keep the kwargs fla's signature names, drop the rest.
    return {k: v for k, v in kwargs.items() if k in _FLA_PARAMS}
