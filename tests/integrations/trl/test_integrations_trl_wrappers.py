"""zorro_core.integrations.wrappers: which wrapper a model sits behind, and the contract of `forward_as`.

The DeepSpeed path is the same contract as DDP's: the engine's forward (its pre/post hooks, ZeRO-3's
per-module gathering) runs around zorro's function, which takes the place of the inner module's forward
for that one call. A stand-in engine with DeepSpeedEngine's shape (a `module`, hooks around
`self.module(...)`, `zero_optimization_stage()`) checks that contract here without deepspeed; the real
engine ran on CPU (gloo) in a manual 2-rank run (see the closing note of the TRL integration).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

from zorro_core.integrations.wrappers import Wrapped, forward_as, unwrap


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = []
        self.register_forward_pre_hook(lambda m, a: self.calls.append("inner_pre_hook"))

    def forward(self, x):
        self.calls.append("inner_forward")
        return self.lin(x)


class _FakeEngine(nn.Module):
    """DeepSpeedEngine's shape: forward runs its own work around `self.module(...)`."""

    def __init__(self, module, stage):
        super().__init__()
        self.module, self._stage, self.log = module, stage, []

    def zero_optimization_stage(self):
        return self._stage

    def forward(self, *args, **kwargs):
        self.log.append("engine_pre")
        out = self.module(*args, **kwargs)
        self.log.append("engine_post")
        return out


@pytest.fixture
def fake_deepspeed(monkeypatch):
    mod = types.ModuleType("deepspeed")
    mod.DeepSpeedEngine = _FakeEngine
    monkeypatch.setitem(sys.modules, "deepspeed", mod)
    return mod


def test_forward_as_runs_the_wrappers_forward_and_the_inner_hooks_around_fn():
    inner = _Inner()
    engine = _FakeEngine(inner, stage=2)
    x = torch.randn(2, 3)
    out = forward_as(engine, inner, lambda: (inner.lin(x) * 2,))
    assert engine.log == ["engine_pre", "engine_post"] and inner.calls == ["inner_pre_hook"]
    assert torch.allclose(out[0], inner.lin(x) * 2)
    # the inner module's own forward is back afterwards (a class method: no instance attribute left)
    assert "forward" not in vars(inner) and inner(x).shape == (2, 3) and inner.calls[-1] == "inner_forward"


def test_forward_as_puts_back_an_instance_forward_and_survives_an_error():
    inner = _Inner()
    own = inner.forward  # accelerate's mixed-precision wrapper sets forward on the instance
    inner.__dict__["forward"] = own
    engine = _FakeEngine(inner, stage=2)
    with pytest.raises(RuntimeError, match="boom"):
        forward_as(engine, inner, lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert vars(inner)["forward"] is own


def test_ddp_is_served_through_its_forward(tmp_path):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        inner = _Inner()
        ddp = nn.parallel.DistributedDataParallel(inner)
        w = unwrap(ddp)
        assert isinstance(w, Wrapped) and w.kind == "ddp" and w.inner is inner and not w.sharded
        seen = []
        ddp.register_forward_pre_hook(lambda m, a: seen.append("ddp"))
        x = torch.randn(2, 3)
        (y,) = w.run(lambda: (inner.lin(x),))
        y.sum().backward()  # DDP prepared its reducer in that forward: the backward all-reduces (world of 1)
        assert seen == ["ddp"] and inner.lin.weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_deepspeed_engine_and_zero3_modules(fake_deepspeed):
    inner = _Inner()
    w = unwrap(_FakeEngine(inner, stage=2))
    assert w.kind == "deepspeed" and w.inner is inner and not w.sharded
    w3 = unwrap(_FakeEngine(inner, stage=3))
    assert w3.kind == "deepspeed" and w3.sharded  # ZeRO-3 gathers per forward: one actor forward per call
    log = []
    w3.run(lambda: log.append("fn"))
    assert log == ["fn"] and w3.outer.log == ["engine_pre", "engine_post"]
    # logits mode "memory" reads lm_head.weight outside lm_head's hooks: refused under ZeRO-3
    assert "memory" in unwrap(_FakeEngine(inner, stage=3), logits_mode="memory")
    # the module TRL calls without its engine (no-grad calls): ZeRO-3 tags every parameter with ds_id
    for p in inner.parameters():
        p.ds_id = 0
    z = unwrap(inner)
    assert z.kind == "zero3" and z.sharded and z.inner is inner and "memory" in unwrap(inner, logits_mode="memory")


def test_plain_and_refused_models():
    inner = _Inner()
    assert unwrap(inner).kind == "plain"
    compiled = types.SimpleNamespace()  # a torch.compile'd model keeps the original as _orig_mod
    m = _Inner()
    m._orig_mod = compiled
    assert "compile" in unwrap(m)
