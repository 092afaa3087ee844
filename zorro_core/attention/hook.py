"""The attention hook: one function registered in transformers' AttentionInterface.

The actor switches the model's attention implementation to "zorro" for the duration of its
forward and passes a Route through the forward kwargs; every attention layer then lands
here with q/k/v of the packed row and runs it the route's way:
- split: the plan's `causal` segments, then its `cross` segments, through a varlen backend;
- mask:  one attention over the packed row with the plan's block mask, through the model's
         own eager function or transformers' sdpa function.
No model source is edited; a layer that does not call the interface never sees the plan,
which is why the actor counts the calls and refuses a model where the count is off.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from zorro_core.core.plan import DedupPlan
from zorro_core.attention.padded import cross_attention
from zorro_core.attention.backends import BACKENDS, PADDED

ZORRO_ATTENTION = "zorro"


@dataclass
class Route:
    """How the hook runs the attention of one forward."""

    plan: DedupPlan
    """The batch's dedup plan."""
    mode: str
    """"split" (two varlen calls) or "mask" (one call with the block mask)."""
    backend: str = "reference"
    """Varlen backend name (zorro_core.attention.backends.BACKENDS), split mode."""
    inner: str = "sdpa"
    """"eager", "sdpa" or "flex_attention", mask mode."""
    calls: int = 0
    """Attention layers served so far in this forward."""
    adapter_calls: dict = field(default_factory=dict)
    """Calls served by the family adapters (e.g. "linear_attention"), by kind."""
    _masks: dict = field(default_factory=dict, repr=False)

    def block_mask(self, kind: str, dtype: torch.dtype, window: Optional[int]) -> torch.Tensor:
        key = (kind, dtype, window)
        if key not in self._masks:
            allowed = self.plan.attention_mask() if kind != "flex_attention" else None
            if allowed is not None and window is not None:
                pos = self.plan.position_ids
                allowed = allowed & (pos[:, None] - pos[None, :] < window)
            if kind == "flex_attention":
                from zorro_core.attention.flex import block_mask

                if getattr(self.plan, "is_tree", False):  # sharing="prefix": the trie's mask
                    from zorro_core.attention.tree import tree_block_mask as block_mask
                self._masks[key] = block_mask(self.plan, window)
                return self._masks[key]
            if kind == "eager":
                m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                m = m.masked_fill(~allowed, torch.finfo(dtype).min)
            else:
                m = allowed
            self._masks[key] = m[None, None]
        return self._masks[key]


def split_attention(plan: DedupPlan, q, k, v, scale: float, window: Optional[int], backend: str) -> torch.Tensor:
    """Split mode over the packed row: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D]."""
    if getattr(plan, "is_tree", False):  # sharing="prefix": one call per level of the trie
        from zorro_core.attention.tree import tree_split_attention

        return tree_split_attention(plan, q, k, v, scale, window, backend)
    seg = plan.causal
    tc = seg.total_q
    fn = BACKENDS[backend]
    if plan.cross is None:
        return fn(q, k, v, seg, scale, window)
    q_c, q_x = q.split([tc, q.shape[0] - tc])
    k_c, v_c = k[:tc], v[:tc]
    out_c = fn(q_c, k_c, v_c, seg, scale, window)
    seg = plan.cross
    if backend in PADDED:
        out_x = cross_attention(q_x, k, v, seg, scale, window, exact=backend == "reference")
    else:
        out_x = fn(q_x, k[seg.k_index], v[seg.k_index], seg, scale, window)
    return torch.cat([out_c, out_x])


def _model_eager(module: nn.Module):
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its module; use sdpa")
    return fn


# Attention kwargs of features this hook does not implement: refused rather than ignored.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def check_attention_call(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
    """Refuse an attention call the hook would compute wrong: a KV cache, or a feature it skips."""
    from zorro_core.models.support import UnsupportedModelError

    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"attention feature {name!r} is not implemented by the dedup attention hook")
    if key.shape[-2] != query.shape[-2]:
        raise UnsupportedModelError(
            f"keys ({key.shape[-2]}) outnumber queries ({query.shape[-2]}): a KV cache is in use; "
            "the dedup path runs a full forward without cache"
        )


def zorro_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    route: Optional[Route] = kwargs.get("zorro_route")
    if route is None:
        raise RuntimeError("zorro attention was called without a route: run the model through a zorro actor")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by the dedup path (it would differ per copy)")
    if query.shape[0] != 1:
        raise ValueError(f"the packed row must have batch size 1, got {query.shape[0]}")
    check_attention_call(query, key, kwargs)
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        # Under autocast q/k can leave a float32-weighted q_norm/k_norm in float32 while v is in
        # the autocast dtype; autocast casts SDPA's inputs to its dtype, and so does the hook (the
        # varlen kernels and the CPU flash op are not autocast-aware and refuse mixed dtypes).
        query, key, value = (x.to(torch.get_autocast_dtype(dev)) for x in (query, key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    route.calls += 1
    if route.mode == "mask":
        mask = route.block_mask(route.inner, query.dtype, sliding_window)
        if route.inner == "flex_attention":
            from zorro_core.attention.flex import flex_packed_attention

            return flex_packed_attention(query, key, value, mask, scale), None
        fn = _model_eager(module) if route.inner == "eager" else sdpa_attention_forward
        extra = {"is_causal": False} if route.inner == "sdpa" else {}
        out, _ = fn(module, query, key, value, mask, scaling=scale, dropout=0.0, **extra)
        return out, None

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = split_attention(route.plan, q, k, v, scale, sliding_window, route.backend)
    return out.unsqueeze(0), None


# Not registered in AttentionMaskInterface on purpose: transformers then builds no mask for
# the packed row (the plan carries its structure), so no [T, T] tensor is ever made.
AttentionInterface.register(ZORRO_ATTENTION, zorro_attention)


@contextlib.contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Switch every config of `model` to attention implementation `name`, and back."""
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = name
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
