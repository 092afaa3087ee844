"""Liger kernels: refused with the reason where they cannot run; on a GPU, dedup still verifies.

On CPU the GPU cases skip with the reason; the plumbing (which liger function, which
arguments, module-wide patches restored) is checked against a stand-in liger module.
"""

import sys
import types

import pytest
import torch
from helpers import mixed_batch

import zorro_core.stack.liger as liger_mod
from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.models.presets import build_model, preset_config
from zorro_core.models.registry import FAMILIES
from zorro_core.stack.liger import FLCE_NOTE, LigerSettings, apply_liger, liger_applied, liger_unavailable
from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_REASON = liger_unavailable("qwen3", DEVICE)


# Where liger names its patch function otherwise than apply_liger_kernel_to_<model_type>: liger-kernel
# names its Qwen3.5 functions after the composite model types.
LIGER_NAMES = {"qwen3_5_text": "apply_liger_kernel_to_qwen3_5", "qwen3_5_moe_text": "apply_liger_kernel_to_qwen3_5_moe"}


def test_every_supported_family_has_its_liger_function():
    for name, family in FAMILIES.items():
        assert family.liger_function in (LIGER_NAMES.get(name, f"apply_liger_kernel_to_{name}"), None)


@pytest.mark.parametrize("family,preset", [("deepseek_v3", "tiny-deepseek-v3"), ("glm4_moe", "tiny-glm4-moe")])
def test_a_family_liger_has_no_patch_for_is_refused_with_that_reason(family, preset, monkeypatch):
    """liger-kernel has no DeepSeek-V3 or GLM-4-MoE patch: refused (anywhere, installed or not) with that reason."""
    assert FAMILIES[family].liger_function is None
    model = build_model(preset_config(preset))
    monkeypatch.setattr(liger_mod.importlib.util, "find_spec", lambda name: object())
    for device in ("cpu", "cuda"):
        assert "no patch function for model type" in liger_unavailable(family, device)
    with pytest.raises(ValueError, match="no patch function"):
        apply_liger(model)


def test_refused_with_reason_on_cpu():
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    why = liger_unavailable(model)
    assert "CUDA" in why
    with pytest.raises(ValueError, match="CUDA"):
        apply_liger(model)


def test_unknown_family_refused(monkeypatch):
    monkeypatch.setattr(liger_mod.importlib.util, "find_spec", lambda name: object())
    assert "no Liger patch function" in liger_unavailable("gpt2", "cuda")


@pytest.fixture
def fake_liger(monkeypatch):
    """A stand-in liger_kernel.transformers whose qwen3 function records its arguments and
    patches a module-wide name, as the real one does with apply_rotary_pos_emb."""
    calls = []

    def apply_liger_kernel_to_qwen3(
        rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True, model=None
    ):
        calls.append(
            dict(
                rope=rope,
                cross_entropy=cross_entropy,
                fused_linear_cross_entropy=fused_linear_cross_entropy,
                rms_norm=rms_norm,
                swiglu=swiglu,
                model=model,
            )
        )
        module = sys.modules[type(model).__module__]
        module.apply_rotary_pos_emb = lambda *a, **k: "liger rope"
        module.LigerOnlyName = 1

    lt = types.ModuleType("liger_kernel.transformers")
    lt.apply_liger_kernel_to_qwen3 = apply_liger_kernel_to_qwen3
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", lt)
    sys.modules["liger_kernel"].transformers = lt
    monkeypatch.setattr(liger_mod, "liger_unavailable", lambda model, device=None: None)
    return calls


def test_patch_function_called_on_the_instance(fake_liger):
    from transformers.models.qwen3 import modeling_qwen3

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    original = modeling_qwen3.apply_rotary_pos_emb
    with liger_applied(model) as result:
        assert modeling_qwen3.apply_rotary_pos_emb() == "liger rope"
        (call,) = fake_liger
        assert call["model"] is model
        # FLCE and plain CE passed explicitly as False: liger's own default turns FLCE on.
        assert call["fused_linear_cross_entropy"] is False and call["cross_entropy"] is False
        assert call["rope"] and call["rms_norm"] and call["swiglu"]
        assert result.function == "apply_liger_kernel_to_qwen3"
        assert set(result.applied) == {"rope", "rms_norm", "swiglu"}
        assert set(result.module_patches) == {"apply_rotary_pos_emb", "LigerOnlyName"}
    assert modeling_qwen3.apply_rotary_pos_emb is original
    assert not hasattr(modeling_qwen3, "LigerOnlyName")


def test_flce_is_noted_as_off_zorros_path(fake_liger):
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    with liger_applied(model, LigerSettings(fused_linear_cross_entropy=True, rope=False)) as result:
        assert fake_liger[0]["fused_linear_cross_entropy"] is True
        assert result.notes["fused_linear_cross_entropy"] == FLCE_NOTE
        assert "logits_mode='memory'" in result.as_row()["liger_notes"]


def test_peft_model_is_unwrapped(fake_liger):
    peft = pytest.importorskip("peft")
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with liger_applied(wrapped):
        assert fake_liger[0]["model"] is model


@pytest.mark.skipif(GPU_REASON is not None, reason=str(GPU_REASON))
@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-llama", "tiny-qwen2"])
@pytest.mark.parametrize("split", [True, False])
def test_dedup_with_liger_matches_per_sequence_gpu(family, split):
    """float32 on the GPU, Liger applied: dedup equals the per-sequence reference run through the
    same patched model (float32 noise: ~1e-5 log-prob, ~1e-4 relative gradient)."""
    model = build_model(preset_config(family), dtype=torch.float32, device="cuda", attn_implementation="sdpa")
    batch = mixed_batch().to("cuda")
    w = token_weights(batch, seed=3)
    plain = per_sequence(model, batch, 0.7, w)
    with liger_applied(model) as result:
        assert {"rope", "rms_norm", "swiglu"} <= set(result.applied)
        norm = model.model.norm
        assert "liger" in type(norm).__module__ or "liger" in getattr(norm.forward, "__module__", ""), (
            "RMSNorm not patched"
        )
        ref = per_sequence(model, batch, 0.7, w)
        actor = DeduplicatedActor(model=model, use_split_attention=split, attn_implementation="sdpa")
        lp, ent, grads, _ = actor_run(actor, batch, 0.7, w)
        base_lp, _, base_grads, _ = actor_run(BaselineActor(model=model, attn_implementation="sdpa"), batch, 0.7, w)
    assert (lp - ref[0]).abs().max().item() < 1e-4
    assert (ent - ref[1]).abs().max().item() < 1e-4
    assert max_rel_grad_error(grads, ref[2])[0] < 1e-3
    assert (lp - base_lp).abs().max().item() < 1e-4
    assert max_rel_grad_error(grads, base_grads)[0] < 1e-3
    # Liger's kernels compute the same function as HF's modules (to float32 noise).
    assert (ref[0] - plain[0]).abs().max().item() < 1e-3
