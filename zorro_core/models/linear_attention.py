"""Gated DeltaNet layers (the linear attention of Qwen3-Next and Qwen3.5) over the packed row.

A linear-attention layer mixes tokens in two places, neither of them transformers' attention
interface: a causal depthwise convolution over the pre-conv q/k/v (kernel K), and the chunked
gated delta rule, a recurrence whose state after a prompt summarises it. transformers' layer
forward calls both as module-level functions, so the adapter gives each gated DeltaNet layer of
the models an actor took its own forward (`adapted_forward`, an instance attribute; the class,
transformers' module and every other model are never written to). Without a route in the
forward kwargs it calls the class's forward: the model is unchanged outside the actor. With a
route it runs transformers' computation written out here for the cacheless forward (>= 5.15;
the same ops in the same order, the projections by family: Qwen3-Next's fused, Qwen3.5's
separate), with the conv and the delta rule replaced by the dedup computation below, around the
functions the class's forward would call, looked up at each call (`layer_function`: the module's,
or from transformers 5.25 with `kernels` the layer's own Func copy, where `kernelize` puts a hub
kernel; a kernel swapped in later is the one that runs). Everything else in the layer (projections, gates, norms) is token-wise.
`delta_rule_of` lets a model's layers run a chosen delta rule in every forward (the float64
kernel of zorro_core.verify.delta_rule), again on that model only.

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

import contextlib
import functools
import inspect
import sys
import types
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
import transformers
from packaging.version import Version
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
_CONV_FORWARD = "causal_conv1d_forward"
"""5.25: the layer's conv step (cache, then causal_conv1d_fn); the adapter replaces the step, so a
kernel put in its place (kernels' `kernelize`) is refused: its computation is not the one written out."""


def layer_function(layer: nn.Module, name: str) -> Callable:
    """The function `layer`'s class forward calls under the module-level `name`, at this moment.

    With the `kernels` package (a dependency from transformers 5.25) the module's functions are
    kernels `Func` modules, and each layer holds its own copy (`_kernel_funcs`, made by
    `use_kernelized_func`; `kernelize` swaps a kernel into that copy): the class's forward routes
    the module's Func to the layer's copy. The adapter calls the same: the layer's copy while the
    module still holds the Func the class was built with, else the module's function (a function
    put into the module later is the one the class's forward calls too)."""
    fn = getattr(sys.modules[type(layer).__module__], name)
    # The copies are keyed by the kernel's layer name (chunk_gated_delta_rule), not the function's:
    # each is an instance of its module Func's own class.
    for own in layer.__dict__.get("_kernel_funcs", {}).values():
        if type(own) is type(fn):
            return own
    return fn


def kernelized(fn: Callable) -> bool:
    """Whether `fn` is a kernels Func whose forward `kernelize` replaced with a hub kernel."""
    return isinstance(fn, nn.Module) and "forward" in fn.__dict__


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
    if kernelized(module_kernel):
        # kernelize put kernels-community's fla chunk_gated_delta_rule here (fla's API, varlen)
        if not x.is_cuda:
            raise UnsupportedModelError(
                f"the gated DeltaNet layer's delta rule is a hub kernel (kernelize) and the input is on {x.device}: "
                "the adapter runs hub kernels on CUDA only"
            )
        return module_kernel, True
    if isinstance(module_kernel, nn.Module):
        # A kernels Func (transformers >= 5.25) not kernelized: its function sends inputs on a device
        # fla does not take (CPU) to the PyTorch function itself; fla's is used on CUDA when present.
        return module_kernel, fla_serves(x)
    if fla_serves(x):
        return module_kernel, True
    if fla_available() is None:
        return inspect.unwrap(module_kernel), False
    return module_kernel, False


def delta_varlen(kernel, calls: Calls, x: tuple, init: Optional[torch.Tensor], chunk: int, final: bool, use_fla: bool):
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
        out, state = delta_varlen(kernel, step.calls, x, init, chunk_size, not last, use_fla)
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


# The layers' projections, by family: Qwen3-Next's fused qkvz / ba, Qwen3.5's separate qkv, z, b, a.
_FUSED = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
_SEPARATE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_COMMON = (
    "conv1d",
    "activation",
    "key_dim",
    "value_dim",
    "head_k_dim",
    "head_v_dim",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
)
_MIN_TRANSFORMERS = Version("5.15.0")
_FIRST_UNTESTED = Version("5.26.0")
"""The first release the adapter is not tested on (pyproject caps the range there too): refused, as
5.25 was until the adapter followed its kernels Funcs and its causal_conv1d_forward step."""
_KERNEL_REPEATS_HEADS = Version("5.23.0")
"""Before 5.23 the layer repeats query and key up to the value heads (num_v_heads // num_k_heads) before
the delta rule, whose PyTorch function takes equal head counts; from 5.23 the function repeats them
itself. The adapter repeats where the installed layer does (Qwen3-Next's real config has 16 key and 32
value heads): a GPU run on 5.17 found the adapter following only the newer convention."""
_SPLIT_FOR_STATES = Version("5.25.0")
"""From 5.25 the layer splits q/k/v/beta/g at the tokens whose intermediate states a cache keeps (none
without a cache) and concatenates the outputs: the same views and copy are taken here, since they change
the order of dt_bias's gradient reduction (a 1e-16 relative difference: the written-out layer would no
longer equal the class's forward bitwise)."""
_CHOOSER = "zorro_delta_rule"
"""A layer's instance attribute: (module kernel, query) -> the delta rule its forwards run (`delta_rule_of`)."""


def check_adaptable(layer: nn.Module) -> None:
    """Refuse a gated DeltaNet layer whose forward the adapter does not reproduce, with the reason."""
    if Version(transformers.__version__) < _MIN_TRANSFORMERS:
        raise UnsupportedModelError(
            f"transformers {transformers.__version__}: the gated DeltaNet adapter needs >= {_MIN_TRANSFORMERS} "
            "(older releases' layers call the kernels bound on the layer)"
        )
    if Version(transformers.__version__) >= _FIRST_UNTESTED:
        raise UnsupportedModelError(
            f"transformers {transformers.__version__}: the gated DeltaNet adapter is tested up to 5.25 "
            f"(releases from {_FIRST_UNTESTED} are not tested); use transformers < {_FIRST_UNTESTED}"
        )
    mod = sys.modules[type(layer).__module__]
    missing = [name for name in (_CONV_FN, _DELTA_FN) if not callable(getattr(mod, name, None))]
    missing += [name for name in _COMMON if not hasattr(layer, name)]
    if not all(hasattr(layer, name) for name in _FUSED) and not all(hasattr(layer, name) for name in _SEPARATE):
        missing.append(f"either {' / '.join(_FUSED)} or {' / '.join(_SEPARATE)}")
    if missing:
        raise UnsupportedModelError(
            f"{type(layer).__qualname__} ({mod.__name__}) has no {', '.join(missing)}: this gated DeltaNet is not supported"
        )
    _check_conv_step(layer)


def _check_conv_step(layer: nn.Module) -> None:
    """Refuse a layer whose conv step (5.25's causal_conv1d_forward) a hub kernel replaced."""
    if hasattr(sys.modules[type(layer).__module__], _CONV_FORWARD) and kernelized(layer_function(layer, _CONV_FORWARD)):
        raise UnsupportedModelError(
            f"{type(layer).__qualname__}'s {_CONV_FORWARD} is a hub kernel (kernelize): the dedup path replaces "
            "that step with transformers' causal_conv1d_fn and would not run the model's own computation"
        )


def install_linear_attention(model: nn.Module) -> None:
    """Give every gated DeltaNet layer of `model` the adapted forward (idempotent; this model's layers only).

    The adapter acts only when a route is in the call's kwargs. A layer whose forward was already
    replaced on the instance by someone else is left as it is: if that forward bypasses the
    adapter, the actor's call count refuses the forward. Nothing outside the layers is written.
    """
    for layer in linear_layers(model):
        check_adaptable(layer)
        if "forward" not in layer.__dict__:
            layer.forward = types.MethodType(adapted_forward, layer)


def uninstall_linear_attention(model: nn.Module) -> None:
    """Give the gated DeltaNet layers of `model` their class's forward back (a no-op where none was adapted)."""
    for layer in linear_layers(model):
        if getattr(layer.__dict__.get("forward"), "zorro_adapted", False):
            del layer.forward


@contextlib.contextmanager
def delta_rule_of(model: nn.Module, choose: Callable[[Callable, torch.Tensor], Callable]) -> Iterator[None]:
    """Within: every forward of `model`'s gated DeltaNet layers, with a route and without, runs the
    delta rule `choose(the module's kernel at the call, the query)`; other models, and transformers'
    modules, are untouched. The layers get the adapted forward (kept after the block: without a
    route or a choice it runs the class's forward); copies of the model made inside the block (deepcopy)
    keep the choice. A model without such layers is left as it is."""
    layers = linear_layers(model)
    install_linear_attention(model)
    saved = [layer.__dict__.get(_CHOOSER) for layer in layers]
    try:
        for layer in layers:
            layer.__dict__[_CHOOSER] = choose
        yield
    finally:
        for layer, before in zip(layers, saved):
            if before is None:
                layer.__dict__.pop(_CHOOSER, None)
            else:
                layer.__dict__[_CHOOSER] = before


def delta_rule_chosen(model: nn.Module) -> bool:
    """Whether a `delta_rule_of` block has chosen the delta rule of `model`'s gated DeltaNet layers."""
    return any(_CHOOSER in layer.__dict__ for layer in linear_layers(model))


def adapted_forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A gated DeltaNet layer's forward: its class's forward (transformers' code) unless a route is
    in the kwargs or the layer has a delta-rule choice (`delta_rule_of`); then the same computation
    written out here, the conv and the delta rule through the adapter (see the module docstring)."""
    route = kwargs.get("zorro_route")
    choose = self.__dict__.get(_CHOOSER)
    if route is None and choose is None:
        return type(self).forward(self, *args, **kwargs)
    hidden_states, cache, attention_mask = _layer_inputs(args, kwargs)
    if cache is not None:
        why = "the dedup path runs" if route is not None else "a chosen delta rule (delta_rule_of) runs in"
        raise UnsupportedModelError(
            f"a recurrent cache (conv or delta-rule state) is not supported: {why} a full forward without "
            "cache (use_cache=False)"
        )
    # As transformers' force_accelerate_hooks: the conv's weight is read directly, not through its forward.
    hook = getattr(self.conv1d, "_hf_hook", None)
    if hook is not None:
        hook.pre_forward(self.conv1d)
    try:
        return _layer_computation(self, hidden_states, attention_mask, choose, kwargs)
    finally:
        if hook is not None:
            hook.post_forward(self.conv1d, ())


adapted_forward.zorro_adapted = True  # type: ignore[attr-defined]


def _layer_inputs(args: tuple, kwargs: dict) -> tuple[torch.Tensor, Any, Optional[torch.Tensor]]:
    """hidden_states, cache, attention_mask of the layer's call (popped from kwargs); the cache under
    its current name or its deprecated one."""
    names = ("hidden_states", "cache", "attention_mask")
    if len(args) > len(names):
        raise TypeError(f"the gated DeltaNet forward takes at most {len(names)} positional arguments, got {len(args)}")
    given = dict(zip(names, args))
    for name in names:
        if name in kwargs:
            if name in given:
                raise TypeError(f"the gated DeltaNet forward got {name} twice")
            given[name] = kwargs.pop(name)
    cache = given.get("cache")
    legacy = kwargs.pop("cache_params", None)
    if "hidden_states" not in given:
        raise TypeError("the gated DeltaNet forward needs hidden_states")
    return given["hidden_states"], cache if cache is not None else legacy, given.get("attention_mask")


def _layer_computation(self, hidden_states, attention_mask, choose, kwargs: dict) -> torch.Tensor:
    """transformers' gated DeltaNet forward without cache (>= 5.15), step for step: the same ops in
    the same order, so without a route it equals the class's forward bitwise (a test checks it).
    The conv and the delta rule are the functions the class's forward calls (`layer_function`); on
    5.25 its causal_conv1d_forward step is, without a cache, causal_conv1d_fn of the squeezed weight."""
    _check_conv_step(self)
    if attention_mask is not None:  # transformers' apply_mask_to_padding_states
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    bsz, seq_len = hidden_states.shape[:2]
    if hasattr(self, "in_proj_qkvz"):
        query, key, value, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )
        query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
        mixed_qkv = torch.cat((query, key, value), dim=-1).transpose(1, 2)
    else:
        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states).reshape(bsz, seq_len, -1, self.head_v_dim)
        b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)

    route = kwargs.get("zorro_route")
    kept = None
    region = getattr(route, "region", None) if route is not None else None
    if region is not None:  # the prompt-once schedule: the prompts' state and conv window kept
        if region.linear is None:
            raise UnsupportedModelError("a gated DeltaNet layer under a key region that does not serve it")
        kept = region.linear(region, route, self)
        conv_fn = layer_function(self, _CONV_FN)
        weight = self.conv1d.weight.squeeze(1)
        mixed_qkv = kept.conv(conv_fn, mixed_qkv, weight, self.conv1d.bias, self.activation)
    else:
        mixed_qkv = _dedup_conv(
            layer_function(self, _CONV_FN),
            mixed_qkv,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            activation=self.activation,
            **kwargs,
        )
    mixed_qkv = mixed_qkv.transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(bsz, seq_len, -1, self.head_k_dim)
    key = key.reshape(bsz, seq_len, -1, self.head_k_dim)
    value = value.reshape(bsz, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    repeats = self.num_v_heads // self.num_k_heads
    if repeats > 1 and Version(transformers.__version__) < _KERNEL_REPEATS_HEADS:
        query = query.repeat_interleave(repeats, dim=2)
        key = key.repeat_interleave(repeats, dim=2)

    split = Version(transformers.__version__) >= _SPLIT_FOR_STATES
    if split:  # torch.tensor_split at seq_len: the chunked part is every token, the sequential part empty
        query, key, value, beta, g = (torch.tensor_split(x, [seq_len], dim=1)[0] for x in (query, key, value, beta, g))
    kernel = layer_function(self, _DELTA_FN)
    if choose is not None:
        kernel = choose(kernel, query)
    if kept is not None:
        core = kept.delta_rule(kernel, query, key, value, g, beta)
    else:
        core, _ = _dedup_delta_rule(
            kernel,
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=kwargs.pop("cu_seq_lens_q", None),
            **kwargs,
        )
    if split:
        core = torch.cat([core], dim=1)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    out = self.out_proj(core.reshape(bsz, seq_len, -1))
    return kept.finish(out) if kept is not None else out
