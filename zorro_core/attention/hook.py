"""The attention hook: what an attention layer runs when a zorro Route is in its kwargs.

The actor registers a dispatching function once (zorro_core.attention.registration) and passes
a Route through the forward kwargs; every attention layer then lands here with q/k/v of the
packed row and runs it the route's way:
- split: the plan's `causal` segments, then its `cross` segments, through a varlen backend;
- mask:  one attention over the packed row with the plan's block mask, through the model's
         own eager function or transformers' sdpa function;
- plain: the padded baseline's batch through the named implementation with its own masks.
No model source is edited; a layer that does not call the interface never sees the plan,
which is why the actor counts the calls and refuses a model where the count is off. Calls
made by the recompute of gradient checkpointing (in backward) land here too, with the same
route, after the actor has checked the count of its forward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from zorro_core.attention.backends import BACKENDS
from zorro_core.attention.flex import block_mask as flex_block_mask
from zorro_core.attention.flex import flex_packed_attention
from zorro_core.attention.tree import tree_block_mask, tree_split_attention
from zorro_core.errors import UnsupportedModelError
from zorro_core.plan.prompt import DedupPlan

ZORRO_ATTENTION = "zorro"


@dataclass
class Route:
    """How the hook runs the attention of one forward."""

    plan: Optional[DedupPlan]
    """The batch's dedup plan (None in plain mode)."""
    mode: str
    """"split" (two varlen calls), "mask" (one call with the block mask) or "plain" (padded batch)."""
    backend: str = "reference"
    """Varlen backend name (zorro_core.attention.backends.BACKENDS), split mode."""
    inner: str = "sdpa"
    """"eager", "sdpa" or "flex_attention", mask mode; any attention implementation, plain mode."""
    mask_of: Optional[Callable] = None
    """Plain mode: window (None: full attention) -> the attention mask of the layers with that window."""
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
                tree = getattr(self.plan, "is_tree", False)  # sharing="prefix": the trie's mask
                self._masks[key] = (tree_block_mask if tree else flex_block_mask)(self.plan, window)
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
        return tree_split_attention(plan, q, k, v, scale, window, backend)
    be = BACKENDS[backend]
    if plan.cross is None:
        return be.causal(q, k, v, plan.causal, scale, window)
    tc = plan.causal.total_q
    out_c = be.causal(q[:tc], k[:tc], v[:tc], plan.causal, scale, window)
    out_x = be.cross(q[tc:], k, v, plan.cross, scale, window)
    return torch.cat([out_c, out_x])


def _model_eager(module: nn.Module):
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its module; use sdpa")
    return fn


def route_mask(device: torch.device | str) -> torch.Tensor:
    """The `attention_mask` an actor passes with a route: an empty 4D mask.

    transformers uses a 4D mask as given and builds none, so no [T, T] mask is made for the
    packed row (the route carries its structure) and the recurrent layers see no padding mask.
    """
    return torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)


# Attention kwargs of features this hook does not implement: refused rather than ignored.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def check_attention_call(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> None:
    """Refuse an attention call the hook would compute wrong: a KV cache, or a feature it skips."""
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
    if route.mode == "plain":
        route.calls += 1
        check_attention_call(query, key, kwargs)
        fn = _model_eager(module) if route.inner == "eager" else ALL_ATTENTION_FUNCTIONS[route.inner]
        rest = {k: v for k, v in kwargs.items() if k != "zorro_route"}
        slot = ("plain", sliding_window)  # built once per window, shared by the layers with that window
        if slot not in route._masks:
            route._masks[slot] = route.mask_of(sliding_window)
        return fn(
            module,
            query,
            key,
            value,
            route._masks[slot],
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            **rest,
        )
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
            return flex_packed_attention(query, key, value, mask, scale), None
        fn = _model_eager(module) if route.inner == "eager" else sdpa_attention_forward
        extra = {"is_causal": False} if route.inner == "sdpa" else {}
        out, _ = fn(module, query, key, value, mask, scaling=scale, dropout=0.0, **extra)
        return out, None

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = split_attention(route.plan, q, k, v, scale, sliding_window, route.backend)
    return out.unsqueeze(0), None
