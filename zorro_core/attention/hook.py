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

import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from zorro_core.attention.backends import BACKENDS
from zorro_core.attention.flex import block_mask as flex_block_mask
from zorro_core.attention.flex import flex_packed_attention
from zorro_core.attention.layouts import layouts_of
from zorro_core.attention.merged import merged_split_attention
from zorro_core.attention.tree import tree_block_mask, tree_split_attention
from zorro_core.distributed.ulysses import SequenceParallel
from zorro_core.errors import UnsupportedModelError
from zorro_core.plan.prompt import PromptPlan
from zorro_core.plan.protocol import Plan
from zorro_core.plan.trie import TriePlan

ZORRO_ATTENTION = "zorro"


@dataclass(frozen=True)
class RouteSpec:
    """How the hook runs an actor's attention: fixed when the actor is built."""

    mode: str
    """"split" (varlen calls per the plan), "mask" (one call with the block mask) or "plain" (padded batch)."""
    backend: str = "reference"
    """Varlen backend name (zorro_core.attention.backends.BACKENDS), split mode."""
    attention: str = "sdpa"
    """The attention implementation: "eager", "sdpa" or "flex_attention" in mask mode; any in plain mode."""


class Route:
    """One forward's route: the actor's spec, the batch's plan, and what the forward counts and caches.

    Passed to every attention layer through the forward kwargs (`zorro_route`); a new Route per
    forward, so nothing of one forward leaks into the next."""

    def __init__(
        self,
        spec: RouteSpec,
        plan: Optional[Plan],
        mask_of: Optional[Callable] = None,
        sequence_parallel: Optional[SequenceParallel] = None,
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.mask_of = mask_of
        """Plain mode: window (None: full attention) -> the attention mask of the layers with that window."""
        self.sequence_parallel = sequence_parallel
        """Split mode under Ulysses: q/k/v are this rank's slice of the packed row (zorro_core.distributed.ulysses)."""
        self.calls = 0
        """Attention layers served so far in this forward."""
        self.adapter_calls: dict[str, int] = {}
        """Calls served by the family adapters (e.g. "linear_attention"), by kind."""
        self.region: Optional[Any] = None
        """The prompt-once schedule's KeyRegion (zorro_core.attention.external): when set, every
        attention layer runs against it instead of the plan's calls."""
        self._masks: dict[tuple, Any] = {}

    @property
    def mode(self) -> str:
        return self.spec.mode

    def count_adapter_call(self, kind: str) -> None:
        self.adapter_calls[kind] = self.adapter_calls.get(kind, 0) + 1

    def plain_mask(self, window: Optional[int]) -> Any:
        """Plain mode: the padded batch's mask for layers with `window`, built once per window."""
        key = ("plain", window)
        if key not in self._masks:
            if self.mask_of is None:
                raise RuntimeError("a plain route needs mask_of")
            self._masks[key] = self.mask_of(window)
        return self._masks[key]

    def block_mask(self, dtype: torch.dtype, window: Optional[int]) -> Any:
        """Mask mode: the plan's mask in the form the attention implementation takes, built once
        per (dtype, window) and shared by the layers."""
        kind = self.spec.attention
        key = (kind, dtype, window)
        if key not in self._masks:
            if self.plan is None:
                raise RuntimeError("mask mode needs a plan")
            if kind == "flex_attention":
                self._masks[key] = plan_block_mask(self.plan, window)
                return self._masks[key]
            allowed = self.plan.attention_mask()
            if window is not None:
                pos = self.plan.position_ids
                allowed = allowed & (pos[:, None] - pos[None, :] < window)
            if kind == "eager":
                m = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
                m = m.masked_fill(~allowed, torch.finfo(dtype).min)
            else:
                m = allowed
            self._masks[key] = m[None, None]
        return self._masks[key]


@functools.singledispatch
def split_attention(plan: Plan, q, k, v, scale: float, window: Optional[int], backend: str) -> torch.Tensor:
    """Split mode over the packed row: q [T, Hq, D], k, v [T, Hkv, D] -> [T, Hq, D], one
    implementation per plan type (registered below)."""
    raise UnsupportedModelError(f"split attention has no implementation for a {type(plan).__name__}")


@split_attention.register
def _(plan: PromptPlan, q, k, v, scale: float, window: Optional[int], backend: str) -> torch.Tensor:
    """The prompt plan: the causal call, then the cross call of shared groups' responses."""
    be = BACKENDS[backend]
    if be.pair is not None and be.gather_free(plan, q, window):
        return merged_split_attention(plan, q, k, v, scale, be.pair)
    layouts = layouts_of(plan)
    if plan.cross is None:
        return be.causal(q, k, v, plan.causal, scale, window, layouts)
    tc = plan.causal.total_q
    out_c = be.causal(q[:tc], k[:tc], v[:tc], plan.causal, scale, window, layouts)
    out_x = be.cross(q[tc:], k, v, plan.cross, scale, window, layouts)
    return torch.cat([out_c, out_x])


split_attention.register(TriePlan, tree_split_attention)  # one call per level of the trie


@functools.singledispatch
def plan_block_mask(plan: Plan, window: Optional[int]) -> Any:
    """The plan's mask as a FlexAttention BlockMask, one builder per plan type."""
    raise UnsupportedModelError(f"flex attention has no block mask for a {type(plan).__name__}")


plan_block_mask.register(PromptPlan, flex_block_mask)
plan_block_mask.register(TriePlan, tree_block_mask)


def original_function(module: nn.Module, original: str):
    """The attention function `original` names, as the model's own attention layer resolves it: "eager"
    is the eager_attention_forward of the layer's modeling module, any other name transformers' registry."""
    if original == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"{type(module).__name__} has no eager_attention_forward in its module; use sdpa")
        return fn
    return ALL_ATTENTION_FUNCTIONS[original]


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
    """What every attention layer runs under the actor: the route's mode (module docstring)."""
    route: Optional[Route] = kwargs.get("zorro_route")
    if route is None:
        raise RuntimeError("zorro attention was called without a route: run the model through a zorro actor")
    if route.mode == "plain":
        return _plain_mode(module, route, query, key, value, scaling, dropout, sliding_window, kwargs)
    query, key, value = _packed_inputs(query, key, value, dropout, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    route.calls += 1
    if route.region is not None:
        backend = route.spec.backend if route.mode == "split" else None
        return route.region.attend(module, query, key, value, scale, sliding_window, backend), None
    if route.mode == "mask":
        if route.sequence_parallel is not None:
            raise UnsupportedModelError("mask mode under Ulysses sequence parallelism (split mode serves it)")
        return _mask_mode(module, route, query, key, value, scale, sliding_window)
    return _split_mode(route, query, key, value, scale, sliding_window)


def _plain_mode(
    module: nn.Module,
    route: Route,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: Optional[float],
    dropout: float,
    sliding_window: Optional[int],
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """The padded baseline's call: the named implementation with the route's plain mask."""
    route.calls += 1
    check_attention_call(query, key, kwargs)
    attention = route.spec.attention
    fn = original_function(module, attention)
    rest = {k: v for k, v in kwargs.items() if k != "zorro_route"}
    return fn(
        module,
        query,
        key,
        value,
        route.plain_mask(sliding_window),
        scaling=scaling,
        dropout=dropout,
        sliding_window=sliding_window,
        **rest,
    )


def _packed_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout: float, kwargs: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed row's q/k/v, checked (no dropout, batch size 1, no cache or skipped feature) and
    in autocast's dtype under autocast."""
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
    return query, key, value


def _mask_mode(
    module: nn.Module,
    route: Route,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
) -> tuple[torch.Tensor, None]:
    """One attention over the packed row with the plan's block mask (flex, sdpa or the model's eager)."""
    attention = route.spec.attention
    mask = route.block_mask(query.dtype, sliding_window)
    if attention == "flex_attention":
        return flex_packed_attention(query, key, value, mask, scale), None
    if attention == "sdpa":
        out, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=scale, dropout=0.0, is_causal=False)
    else:
        out, _ = original_function(module, "eager")(module, query, key, value, mask, scaling=scale, dropout=0.0)
    return out, None


def _split_mode(
    route: Route,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
) -> tuple[torch.Tensor, None]:
    """The plan's varlen calls over the packed row, by plan type: q/k/v [1, H, T, D] -> [1, T, H, D]."""
    if route.plan is None:
        raise RuntimeError("split mode needs a plan")
    plan = route.plan
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    sp = route.sequence_parallel
    if sp is None:
        out = split_attention(plan, q, k, v, scale, sliding_window, route.spec.backend)
    else:
        out = sp.attention(
            lambda q, k, v: split_attention(plan, q, k, v, scale, sliding_window, route.spec.backend),
            q,
            k,
            v,
            plan.num_tokens,
        )
    return out.unsqueeze(0), None
