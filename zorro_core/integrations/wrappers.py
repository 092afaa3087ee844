"""The distributed wrapper a trainer's model sits behind, and zorro's forward run through its hooks.

A trainer hands its log-prob method either the module itself or the wrapper its launcher built.
Each wrapper does work in its forward that the backward relies on, so the deduplicated forward
must run inside that forward, never by calling the inner module and skipping it:

- `DistributedDataParallel` (accelerate's multi-process default): its forward prepares the
  reducer (`prepare_for_forward`/`prepare_for_backward`; unused-parameter search and the
  `_DDPSink` with `find_unused_parameters`), broadcasts buffers and rebuilds buckets. Without it
  the backward's gradient hooks do not all-reduce. `forward_as` runs zorro's function as the
  inner module's forward for one call of the wrapper, so all of DDP's forward runs around it.
- FSDP2 (`fully_shard`, accelerate's FSDP plugin with `fsdp_version: 2`): not a wrapper but the
  module itself; the actors run their computation as a registered forward method of the root
  (`zorro_core.actor.fsdp.as_root_forward`), and every decoder layer keeps its own hooks.
- DeepSpeed: the engine's forward runs around zorro's function like DDP's (`forward_as`). ZeRO-3
  partitions every parameter and gathers a module's own parameters in that module's hooks, so
  the actors must reach weights only by calling modules (logits mode "memory" reads
  `lm_head.weight` directly: refused under ZeRO-3).

Sharded models (FSDP2, ZeRO-3) gather parameters with collectives in every forward of every
layer, so every rank must make the same number of forwards in a call: `Wrapped.sharded` tells
the trainer to run one actor forward per call (or TRL's own chunks, whose number is the same on
every rank), never a number of chunks that depends on the rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union, cast

from torch import nn
from torch.distributed.fsdp import FSDPModule

from zorro_core.actor.fsdp import is_fsdp_root

KINDS = ("plain", "ddp", "fsdp2", "deepspeed", "zero3")
"""plain: no wrapper; ddp; fsdp2: a fully_shard root; deepspeed: a DeepSpeedEngine; zero3: a module
whose parameters ZeRO-3 partitions, called without its engine (TRL's no-grad calls)."""


@dataclass(frozen=True)
class Wrapped:
    """A model as the trainer passed it: the module zorro's actor is built on, and how to call it."""

    kind: str
    """One of KINDS."""
    inner: nn.Module
    """The model itself (the actor's model): DDP's / the engine's `.module`, else the model."""
    outer: nn.Module
    """What the trainer passed."""
    sharded: bool
    """Parameters gathered per forward by collectives (FSDP2, ZeRO-3): equal forward counts per rank."""

    def run(self, fn: Callable[[], Any]) -> Any:
        """`fn()` inside the wrapper's forward (DDP, DeepSpeed engine); FSDP2 roots are entered by the
        actor itself, ZeRO-3 modules by their own hooks; plain models run `fn()` directly."""
        if self.kind in ("ddp", "deepspeed"):
            return forward_as(self.outer, self.inner, fn)
        return fn()


def forward_as(outer: nn.Module, inner: nn.Module, fn: Callable[[], Any]) -> Any:
    """`outer()` with `inner.forward` replaced by `fn` for this one call.

    The wrapper's whole forward (pre-forward, the call of its module with that module's hooks,
    post-forward) runs around `fn`. `fn` must return its differentiable results as tensors or
    tuples of tensors: DDP finds the outputs its backward waits on by flattening the return value.
    An instance-level `forward` (accelerate's mixed-precision wrapper) is put back afterwards.
    """
    own = inner.__dict__
    had, saved = "forward" in own, own.get("forward")
    own["forward"] = lambda *args, **kwargs: fn()
    try:
        return outer()
    finally:
        if had:
            own["forward"] = saved
        else:
            del own["forward"]


def _is_ddp(model: nn.Module) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _deepspeed_engine_class():
    import sys

    if "deepspeed" not in sys.modules:  # never import deepspeed for a model that cannot be behind it
        return None
    try:
        from deepspeed import DeepSpeedEngine
    except ImportError:
        return None
    return DeepSpeedEngine


def zero3_partitioned(model: nn.Module) -> bool:
    """Whether ZeRO-3 partitions `model`'s parameters (DeepSpeed tags each with `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def unwrap(model: nn.Module, logits_mode: str = "compute") -> Union[Wrapped, str]:
    """The Wrapped view of what a trainer passed, or why zorro does not serve it."""
    if _is_ddp(model):
        inner = cast(nn.Module, model.module)
        if is_fsdp_root(inner) or _is_fsdp1(inner):
            return "a model sharded with FSDP inside DistributedDataParallel is not served"
        return Wrapped("ddp", inner, model, sharded=False)
    engine = _deepspeed_engine_class()
    if engine is not None and isinstance(model, engine):
        inner = cast(nn.Module, model.module)
        stage = int(model.zero_optimization_stage())
        if stage == 3 and logits_mode == "memory":
            return "logits_mode 'memory' reads lm_head.weight outside lm_head's ZeRO-3 hooks: use 'compute' or 'none'"
        return Wrapped("deepspeed", inner, model, sharded=stage == 3)
    if _is_fsdp1(model):
        return (
            "FSDP1 (FullyShardedDataParallel) is not served: its flat parameters are gathered only in "
            "its wrapper's forward; use FSDP2 (accelerate's fsdp_version: 2)"
        )
    if is_fsdp_root(model):
        return Wrapped("fsdp2", model, model, sharded=True)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return (
            "FSDP2 with fully_shard on inner modules but not on the model itself is not served: the "
            "embedding and lm_head would stay sharded outside a root's hooks"
        )
    if zero3_partitioned(model):
        if logits_mode == "memory":
            return "logits_mode 'memory' reads lm_head.weight outside lm_head's ZeRO-3 hooks: use 'compute' or 'none'"
        return Wrapped("zero3", model, model, sharded=True)
    if type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod"):
        return "a torch.compile'd model is not served by the dedup path"
    return Wrapped("plain", model, model, sharded=False)
