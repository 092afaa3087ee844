"""Qwen3-Next and Qwen3.5 on CPU where flash-linear-attention is importable: zorro's adapter runs the PyTorch
delta rule, chosen by the tensors' device, although transformers resolved its kernel to fla's at
import without looking at the device. Simulated (every run) and with fla installed."""

import inspect

import pytest
import torch
from fla_devices import (
    KERNEL,
    assert_refuses_cpu,
    cpu_fallback_by_device,
    device_aware,
    family_module,
    qwen3_next_module,
    simulate_fla,
)
from helpers import LP_ATOL
from versions import skip_module_without_qwen3_next_adapter

from zorro_core import BaselineActor, DeduplicatedActor, RolloutBatch
from zorro_core.models import linear_attention
from zorro_core.models.linear_attention import delta_rule_kernel, fla_available
from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

skip_module_without_qwen3_next_adapter()
pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
FAMILIES = ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"]
# transformers' kernel computes in float32 inside a float64 model: gradients at its floor
# (measured 1.2e-4 relative; test_families_linear.test_unmodified_float32_kernel).
GRAD_FLOOR = 1e-3


def batch() -> RolloutBatch:
    """Prompts across the 64-token chunk boundary, shared, so the head and branch calls both run."""
    gen = torch.Generator().manual_seed(4)
    p = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (70, 30)]
    r = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (5, 9, 2, 4)]
    return RolloutBatch.from_lists([p[0], p[1], p[0], p[1]], r)


@pytest.fixture(scope="module")
def references(tiny_models):
    """get(family): per-sequence reference through transformers' PyTorch kernel (the model's forward, no actor)."""
    cache = {}

    def get(family):
        if family not in cache:
            mod = family_module(family)
            saved = getattr(mod, KERNEL)
            setattr(mod, KERNEL, device_aware(saved))
            try:
                b = batch()
                w = token_weights(b, seed=2)
                cache[family] = b, w, per_sequence(tiny_models(family), b, 1.0, w)
            finally:
                setattr(mod, KERNEL, saved)
        return cache[family]

    return get


def _check(actor, reference):
    b, w, ref = reference
    lp, ent, grads, _ = actor_run(actor, b, 1.0, w)
    assert (lp - ref[0]).abs().max().item() < LP_ATOL
    assert (ent - ref[1]).abs().max().item() < LP_ATOL
    assert max_rel_grad_error(grads, ref[2])[0] < GRAD_FLOOR


def test_kernel_chosen_by_device_when_fla_resolved(monkeypatch):
    """fla importable: CUDA tensors get the module's (fla) kernel; CPU tensors the PyTorch function behind it."""
    fake = simulate_fla(monkeypatch)
    kernel, is_fla = delta_rule_kernel(fake, torch.zeros(1))
    assert not is_fla and kernel is inspect.unwrap(qwen3_next_module().torch_chunk_gated_delta_rule)
    assert kernel is not fake
    monkeypatch.setattr(linear_attention, "fla_serves", lambda x: True)  # as on CUDA
    assert delta_rule_kernel(fake, torch.zeros(1)) == (fake, True)


def test_kernel_untouched_without_fla(monkeypatch):
    monkeypatch.setattr(linear_attention, "fla_available", lambda: "not installed")
    kernel = qwen3_next_module().torch_chunk_gated_delta_rule
    assert delta_rule_kernel(kernel, torch.zeros(1)) == (kernel, False)


@pytest.mark.parametrize("actor_cls", [DeduplicatedActor, BaselineActor])
@pytest.mark.parametrize("family", FAMILIES)
def test_simulated_fla_cpu_runs_the_pytorch_kernel(tiny_models, references, monkeypatch, family, actor_cls):
    """Every run: transformers' kernel resolved to a stand-in of fla that refuses CPU tensors; the
    actors (both route their forward through the adapter) never call it and equal the reference."""
    fake = simulate_fla(monkeypatch, family)
    _check(actor_cls(model=tiny_models(family)), references(family))
    assert fake.calls == 0


@pytest.mark.skipif(fla_available() is not None, reason=f"{fla_available()}")
@pytest.mark.parametrize("actor_cls", [DeduplicatedActor, BaselineActor])
@pytest.mark.parametrize("family", FAMILIES)
def test_installed_fla_cpu_runs_the_pytorch_kernel(tiny_models, references, family, actor_cls):
    """fla installed: transformers' module kernel is fla's (before 5.25 it fails on CPU tensors; from 5.25
    transformers' wrapper itself takes the PyTorch path for them); the actors on CPU run the PyTorch
    kernel and equal the reference either way (issue 60, defect 14)."""
    if not cpu_fallback_by_device(getattr(family_module(family), KERNEL)):
        assert_refuses_cpu(getattr(family_module(family), KERNEL))
    _check(actor_cls(model=tiny_models(family)), references(family))


def test_the_reference_keeps_an_exact_delta_rule_chosen_around_it(tiny_models, monkeypatch):
    """Issue 60, defect 14: where fla is importable the per-sequence reference's device choice replaced an outer
    exact_delta_rule, so the float64 references ran transformers' float32 kernel (A_log's gradient 8e-5 off,
    49 float64 tests failing with fla installed). Simulated: fla importable, the exact rule chosen outside."""
    from zorro_core.verify import delta_rule
    from zorro_core.verify.delta_rule import device_delta_rule, exact_delta_rule

    monkeypatch.setattr(delta_rule, "fla_available", lambda: None)
    model = tiny_models("tiny-qwen3-next")
    calls = []
    real = delta_rule.chunk_gated_delta_rule_exact

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(delta_rule, "chunk_gated_delta_rule_exact", counted)
    with exact_delta_rule(model), device_delta_rule(model):
        model(input_ids=torch.ones(1, 5, dtype=torch.long), use_cache=False)
    assert len(calls) == len(linear_attention.linear_layers(model)), calls
