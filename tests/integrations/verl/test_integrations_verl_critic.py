"""verl's critic (the value model of GAE runs) beside zorro's engine, against the real verl.

zorro does not serve verl's critic yet: its engine is verl's `FSDPEngineWithValueHead` (registered
for `value_model`), which zorro's `install()` leaves alone. What zorro must guarantee meanwhile is
that the critic's micro-batches are sized by the tokens it computes: zorro's dynamic micro-batching
swaps verl's module-level `prepare_micro_batches` for the length of the actor engine's call, and a
critic (or any other engine) micro-batching in the same process during that call, from another
thread, gets verl's own function.
"""

import threading
import types

import pytest

pytest.importorskip("verl")


def test_critic_engine_is_verls(monkeypatch):
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    from zorro_core.integrations.verl.engine import DedupFSDPEngine, install

    install()
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # verl registers its critic engine for cuda / npu
    for backend in ("fsdp", "fsdp2"):
        cls = EngineRegistry.get_engine_cls("value_model", backend)
        assert cls is FSDPEngineWithValueHead and not issubclass(cls, DedupFSDPEngine)


def test_other_engines_micro_batch_with_verls_own_during_a_zorro_call(monkeypatch):
    from verl.workers.engine.fsdp import transformer_impl

    from zorro_core.integrations.verl import batching

    def verls(data, dp_group=None, **kwargs):
        return ("verl", data)

    monkeypatch.setattr(transformer_impl, "prepare_micro_batches", verls)
    monkeypatch.setattr(batching, "zorro_micro_batches", lambda engine, data, dp_group=None, **kw: ("zorro", data))
    monkeypatch.setattr(batching.tu, "get_non_tensor_data", lambda data, key, default=None: True)
    actor_engine = types.SimpleNamespace()
    with batching.swap_prepare_micro_batches(actor_engine):
        assert transformer_impl.prepare_micro_batches("actor rows") == ("zorro", "actor rows")
        seen = []
        critic = threading.Thread(target=lambda: seen.append(transformer_impl.prepare_micro_batches("critic rows")))
        critic.start()
        critic.join()
        assert seen == [("verl", "critic rows")]
        # a second zorro engine's call nested in this context is its own
        other = types.SimpleNamespace()
        with batching.swap_prepare_micro_batches(other):
            assert transformer_impl.prepare_micro_batches("other rows") == ("zorro", "other rows")
        assert transformer_impl.prepare_micro_batches("actor rows") == ("zorro", "actor rows")
    assert transformer_impl.prepare_micro_batches is verls
