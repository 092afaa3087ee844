"""Running the actor's computation as a forward of an FSDP2 root (`fully_shard` on the CausalLM).

FSDP2 gathers a module's own parameters only in hooks around a call of that module (and of
the methods registered with `register_fsdp_forward_method`). Trainers shard each decoder layer
and the CausalLM root; the root then owns the embedding, the final norm and lm_head. The actors
call the base model and lm_head themselves, so without the root's hooks the embedding would be
a sharded DTensor ("aten.embedding.default got mixed torch.Tensor and DTensor"). `as_root_forward`
runs a function through a forward method of the root, registered once per model (on first use,
then reused: nothing on the model is set or removed per call): its pre-forward hook gathers the
root's parameters (and does FSDP's lazy init from the root, so the layers are not mistaken for
roots), its post-forward hook registers the pre-backward hook on the returned tensors, whose
backward then reduce-scatters the root's gradients. The decoder layers keep their own hooks.
A model that is not an FSDPModule runs `fn` directly: nothing changes for it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

_METHOD = "_zorro_forward"


def is_fsdp_root(model: nn.Module) -> bool:
    """Whether `model` was sharded with torch.distributed.fsdp.fully_shard (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def as_root_forward(model: nn.Module, fn: Callable[[], Any]) -> Any:
    """`fn()`, run between the FSDP2 root's forward hooks when `model` is an FSDP2 module.

    `fn` must return its differentiable results as tensors (or tuples/lists/dicts of them):
    FSDP finds the outputs that need its pre-backward hook by flattening the return value.
    """
    if not is_fsdp_root(model):
        return fn()
    method = model.__dict__.get(_METHOD)
    if method is None:
        method = _register(model)
    with warnings.catch_warnings():
        # FSDP warns when an output is a view (an in-place op on it would drop the hook); the
        # actor only reads its outputs with out-of-place ops (index_put into a new tensor).
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        return method(fn)


def _call(fn: Callable[[], Any]) -> Any:
    return fn()


def _register(model: nn.Module):
    """Register `_call` as a forward method of the root, once per model; the registered method.

    register_fsdp_forward_method wraps an attribute of the module instance and calls it without
    `self`, so a plain function taking the computation as its argument serves every call.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method  # lazy: see is_fsdp_root

    object.__setattr__(model, _METHOD, _call)
    register_fsdp_forward_method(model, _METHOD)
    return model.__dict__[_METHOD]
