"""Gated DeltaNet layers (the linear attention of Qwen3-Next and Qwen3.5) over the packed row.

A linear-attention layer mixes tokens in two places, neither of them transformers' attention
interface: a causal depthwise convolution over the pre-conv q/k/v (kernel K), and the chunked
gated delta rule, a recurrence whose state after a prompt summarises it. The adapter wraps
exactly those two functions for the layers of the models an actor took, and nowhere else: each
such layer gets its own copy of its class's forward (the same code, decorators included) whose
two module-level names resolve to the adapter's functions, every other name to the layer's module
as it is at the call. transformers' module is never written to, so another model of the same
class in the process runs transformers' code as it is. The layer passes its forward kwargs, hence
the route, to both functions: with a route they run the dedup computation below, without one the
module's own function (looked up at each call, so a kernel swapped into the module later is the
one that runs), so the model is unchanged outside the actor. Everything else in the layer
(projections, gates, norms) is token-wise and runs untouched.

- Convolution: the model's own conv over the packed row, then the first K-1 tokens of each
  packed segment recomputed over their own sequence's window: for a response, the prompt's last
  K-1 pre-conv inputs; for a prompt, zeros before its start. Prompt tokens are never repeated.
- Delta rule, two varlen calls, the chunk partition of every sequence kept as in a one-shot run:
  head:   each shared prompt up to its last chunk boundary c = floor(P / chunk) * chunk, from a
          zero state, returning its final state; the whole sequence of a one-member group.
  branch: per response of a shared prompt, the prompt's tail [c, P) followed by the response,
          starting from the head's state. The tail is replayed once per response (< chunk
          tokens) so that its chunk holds the same tokens as in the one-shot run; the prompt's
          own tail outputs are taken from its first response's branch.
  Gradients reach the prompt through the carried state, the replayed tail and the conv window.
- The prefix tree (`TriePlan`, sharing="prefix") is the same idea at any depth: each node's
  segment starts at its parent's last chunk boundary from the parent's final state, replaying
  the parent's partial last chunk (one call per tree level); a token's conv window is its own
  path's. Both layouts (which segments, from which state, each token's output) are in
  zorro_core.models.linear_layout, dispatched on the plan type; the adapter runs any of them.
- Backends: flash-linear-attention's chunk_gated_delta_rule when transformers resolved to it
  and the tensors are on CUDA (varlen with cu_seqlens, one initial state per segment);
  otherwise (no fla, or CPU tensors, which fla's kernel cannot take) transformers' PyTorch
  fallback, which ignores cu_seqlens, over a zero-padded batch of the segments (a zero token,
  with g = beta = 0 and k = v = 0, leaves the state untouched, so right-padding is exact).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import Any, Optional

import torch
from torch import nn
from transformers.activations import ACT2FN

from zorro_core.errors import UnsupportedModelError
from zorro_core.models.linear_layout import (  # noqa: F401 - LinearLayout re-exported with the builders
    DEFAULT_CHUNK,
    Calls,
    LinearLayout,
    build_linear_layout,
    conv_sources,
)
from zorro_core.plan.protocol import Plan

# transformers' layer type of a gated DeltaNet layer.
LINEAR_LAYER_TYPES = ("linear_attention",)
_CONV_FN = "causal_conv1d_fn"
_DELTA_FN = "torch_chunk_gated_delta_rule"


@functools.lru_cache(maxsize=None)
def fla_available() -> Optional[str]:
    """None when flash-linear-attention's gated delta rule is importable, else why not."""
    try:  # lazy: flash-linear-attention is an optional package
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return f"flash-linear-attention is not importable ({type(e).__name__}: {e})"
    return None


def fla_serves(x: torch.Tensor) -> bool:
    """Whether the adapter runs flash-linear-attention's delta rule for `x`: fla importable (then
    transformers resolved its delta rule to fla's kernel at import, on every device) and `x` on
    CUDA (fla's Triton kernels have no CPU backend). Otherwise the adapter runs the PyTorch kernel
    (`delta_rule_kernel`)."""
    return x.is_cuda and fla_available() is None


def delta_rule_kernel(module_kernel, x: torch.Tensor):
    """The delta rule the adapter calls for `x`, chosen by `x`'s device, and whether it is fla's.

    `module_kernel` is the layer module's function, which transformers resolves to fla's kernel
    whenever fla is importable, without looking at the device; on CPU the adapter takes the
    PyTorch function that transformers' wrapper keeps behind it (functools.wraps' `__wrapped__`).
    """
    if fla_serves(x):
        return module_kernel, True
    if fla_available() is None:
        return inspect.unwrap(module_kernel), False
    return module_kernel, False


def _delta_varlen(kernel, calls: Calls, x: tuple, init: Optional[torch.Tensor], chunk: int, final: bool, use_fla: bool):
    """Run the delta rule over the segments of `calls`; returns ([N, Hv, Dv] outputs in segment order, final states)."""
    if use_fla:
        args = [a[calls.index][None] for a in x]
        out, state = kernel(
            *args[:3],
            g=args[3],
            beta=args[4],
            initial_state=init,
            output_final_state=final,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=calls.cu.long(),
        )
        return out[0], state
    # PyTorch fallback: right-padded batch (it ignores cu_seqlens; its wrapper refuses them).
    args = [torch.cat([a, a.new_zeros(1, *a.shape[1:])])[calls.padded] for a in x]
    out, state = kernel(
        *args[:3],
        g=args[3],
        beta=args[4],
        chunk_size=chunk,
        initial_state=init,
        output_final_state=final,
        use_qk_l2norm_in_kernel=True,
    )
    return out[calls.valid], state


def _dedup_delta_rule(
    original,
    query,
    key,
    value,
    g,
    beta,
    chunk_size: int = DEFAULT_CHUNK,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens=None,
    **kwargs,
):
    route = kwargs.get("zorro_route")
    if route is None:
        return original(
            query,
            key,
            value,
            g=g,
            beta=beta,
            chunk_size=chunk_size,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=cu_seqlens,
            **kwargs,
        )
    if initial_state is not None or output_final_state or cu_seqlens is not None:
        raise UnsupportedModelError(
            "a recurrent cache (initial_state / output_final_state) is not supported by the dedup path"
        )
    if not use_qk_l2norm_in_kernel:
        raise UnsupportedModelError(
            "the dedup gated DeltaNet adapter expects use_qk_l2norm_in_kernel=True (Qwen3-Next, Qwen3.5)"
        )
    if query.shape[0] != 1:
        raise ValueError(f"the packed row must have batch size 1, got {query.shape[0]}")
    plan = route.plan
    lay = plan.derived(("linear_layout", chunk_size), lambda: build_linear_layout(plan, chunk_size))
    # fla's kernel (CUDA) takes cu_seqlens (true varlen), the PyTorch fallback does not.
    kernel, use_fla = delta_rule_kernel(original, query)
    x = tuple(a[0] for a in (query, key, value, g, beta))
    outs: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    for i, step in enumerate(lay.steps):
        init = None
        if step.state is not None:
            hv, dk, dv = value.shape[2], key.shape[3], value.shape[3]
            zero = torch.zeros(1, hv, dk, dv, dtype=finals[0].dtype if finals else torch.float32, device=query.device)
            init = torch.cat([zero, *finals])[step.state]
        last = i == len(lay.steps) - 1
        out, state = _delta_varlen(kernel, step.calls, x, init, chunk_size, not last, use_fla)
        outs.append(out)
        if not last:
            finals.append(state)
    route.count_adapter_call("linear_attention")
    return torch.cat(outs)[lay.out_index][None], None


def _dedup_conv(original, hidden_states, weight, bias=None, activation=None, **kwargs):
    """Causal depthwise conv of the packed row [1, C, T], each token over its own sequence's inputs."""
    route = kwargs.get("zorro_route")
    if route is None:
        return original(hidden_states, weight, bias, activation=activation, **kwargs)
    if hidden_states.shape[0] != 1:
        raise ValueError(f"the packed row must have batch size 1, got {hidden_states.shape[0]}")
    k = weight.shape[-1]
    plan = route.plan
    if hidden_states.shape[-1] != plan.num_tokens:
        raise UnsupportedModelError(
            f"the conv input has {hidden_states.shape[-1]} positions for a packed row of {plan.num_tokens}: "
            "a conv cache is in use; the dedup path runs a full forward without cache"
        )
    src, fix = plan.derived(("linear_conv", k), lambda: _conv_fixes(plan, k))
    if not fix.numel():
        route.count_adapter_call("linear_conv")
        return original(hidden_states, weight, bias, activation=activation, **kwargs)
    # The model's own conv over the packed row is right wherever a token's window lies inside its
    # own packed segment; only the first K-1 tokens of a segment see the wrong neighbours. Their
    # rows are replaced before the activation, not after: the activation's backward at a replaced
    # row would multiply its zero gradient by the derivative at the wrong window's value, NaN when
    # that window held another sequence's non-finite input (0 x NaN), and carry it into this one.
    out = original(hidden_states, weight, bias, activation=None, **kwargs)
    x = hidden_states[0].t()  # [T, C]
    acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
    xz = torch.cat([x, x.new_zeros(1, x.shape[1])]).to(acc)
    rows = torch.einsum("nkc,ck->nc", xz[src[fix]], weight.to(acc))
    if bias is not None:
        rows = rows + bias.to(acc)
    out = out[0].t().index_copy(0, fix, rows.to(weight.dtype).to(out.dtype)).t()[None]
    if activation is not None:
        out = ACT2FN[activation](out)
    route.count_adapter_call("linear_conv")
    return out


def _conv_fixes(plan: Plan, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """conv_sources, and the packed positions whose sources differ from the packed row's own window."""
    src = conv_sources(plan, kernel_size)
    t = plan.num_tokens
    tok = torch.arange(t, device=src.device)[:, None]
    natural = tok - torch.arange(kernel_size - 1, -1, -1, device=src.device)[None, :]
    natural = torch.where(natural >= 0, natural, t)
    return src, (src != natural).any(1).nonzero().flatten()


def linear_layers(model: nn.Module) -> list[nn.Module]:
    """The gated DeltaNet layers of `model` (modules whose layer_type is linear attention)."""
    return [m for m in model.modules() if getattr(m, "layer_type", None) in LINEAR_LAYER_TYPES and hasattr(m, "conv1d")]


def install_linear_attention(model: nn.Module) -> None:
    """Give every gated DeltaNet layer of `model` the adapted forward (idempotent; this model's layers only).

    The adapter acts only when a route is in the call's kwargs. A layer whose forward was already
    replaced on the instance by someone else is left as it is: if that forward bypasses the
    adapter, the actor's call count refuses the forward. transformers' module functions are left
    as they are.
    """
    for layer in linear_layers(model):
        if "forward" not in layer.__dict__:
            layer.forward = types.MethodType(_adapted_forward(type(layer)), layer)


def uninstall_linear_attention(model: nn.Module) -> None:
    """Give the gated DeltaNet layers of `model` their class's forward back (a no-op where none was adapted)."""
    for layer in linear_layers(model):
        if getattr(layer.__dict__.get("forward"), "zorro_adapted", False):
            del layer.forward


# The adapted forward of each layer class, by the class's forward function.
_ADAPTED: dict = {}


def _adapted_forward(cls: Any):
    """`cls.forward` rebuilt with the conv and delta rule names resolved to the adapter's functions."""
    forward = cls.forward
    if forward not in _ADAPTED:
        mod = sys.modules[cls.__module__]
        missing = [name for name in (_CONV_FN, _DELTA_FN) if getattr(mod, name, None) is None]
        if missing:
            raise UnsupportedModelError(
                f"{mod.__name__} has no {', '.join(missing)}: this transformers version's gated DeltaNet is not supported"
            )
        overrides = {
            _CONV_FN: _routed(mod, _CONV_FN, _dedup_conv),
            _DELTA_FN: _routed(mod, _DELTA_FN, _dedup_delta_rule),
        }
        adapted = _with_globals(forward, overrides, cls)
        adapted.zorro_adapted = True
        _ADAPTED[forward] = adapted
    return _ADAPTED[forward]


def _routed(mod, name: str, fn):
    """`fn(the module's `name` at call time, ...)`: the dedup computation with a route, the module's own without."""

    def call(*args, **kwargs):
        return fn(getattr(mod, name), *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class _LayerGlobals(dict):
    """The globals of an adapted forward: the adapter's names; any other name read from the module at lookup."""

    def __init__(self, module_globals: dict, overrides: dict) -> None:
        super().__init__(overrides)
        # Read by the interpreter from the dict itself (not through __missing__) when the function is built.
        self["__builtins__"] = module_globals["__builtins__"]
        self["__name__"] = module_globals["__name__"]
        self._module_globals = module_globals

    def __missing__(self, name: str):
        return self._module_globals[name]


def _with_globals(fn, overrides: dict, cls: type):
    """A copy of `fn` whose global names in `overrides` resolve there.

    `fn` is a function or a chain of functools.wraps decorators around one: the innermost function
    that names an override is rebuilt with _LayerGlobals, each decorator above it rebuilt with the
    new function in place of the old in its closure.
    """
    if not set(overrides) & set(fn.__code__.co_names):
        inner = getattr(fn, "__wrapped__", None)
        cells = [c for c in fn.__closure__ or () if inner is not None and c.cell_contents is inner]
        if inner is None or not cells:
            raise UnsupportedModelError(
                f"{cls.__qualname__}.forward does not call {' or '.join(overrides)} by name: this transformers "
                "version's gated DeltaNet is not supported"
            )
        new_inner = _with_globals(inner, overrides, cls)
        closure = tuple(types.CellType(new_inner) if c.cell_contents is inner else c for c in fn.__closure__)
        return _copy_function(fn, fn.__globals__, closure, __wrapped__=new_inner)
    return _copy_function(fn, _LayerGlobals(fn.__globals__, overrides), fn.__closure__)


def _copy_function(fn, globals_: dict, closure, **attrs):
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__, new.__annotations__ = fn.__qualname__, fn.__doc__, fn.__annotations__
    new.__dict__.update(fn.__dict__)
    new.__dict__.update(attrs)
    return new
