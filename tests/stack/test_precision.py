"""Precision policy: bf16 / fp16 + loss scaling / float32 by device, float32 master state."""

import dataclasses

import pytest
import torch

from zorro_core import DeduplicatedActor, create_dummy_batch
from zorro_core.models.presets import build_model, preset_config
from zorro_core.stack.precision import DeviceCaps, check_float32_state, device_caps, precision_policy

H100 = DeviceCaps("cuda", "NVIDIA H100", (9, 0))
A100 = DeviceCaps("cuda", "NVIDIA A100", (8, 0))
V100 = DeviceCaps("cuda", "Tesla V100", (7, 0))
T4 = DeviceCaps("cuda", "Tesla T4", (7, 5))
CPU = DeviceCaps("cpu", "cpu")


@pytest.mark.parametrize(
    "caps,dtype,scaling",
    [
        (H100, torch.bfloat16, False),
        (A100, torch.bfloat16, False),
        (V100, torch.float16, True),
        (T4, torch.float16, True),
        (CPU, torch.float32, False),
    ],
)
def test_policy_by_device(caps, dtype, scaling):
    p = precision_policy(caps)
    assert p.compute_dtype == dtype and p.loss_scaling is scaling
    assert p.param_dtype == p.grad_dtype == p.optimizer_state_dtype == torch.float32
    assert p.device_type == caps.type and p.reason
    assert ("loss scaling" in p.reason) == (caps.type == "cuda")
    if caps.type == "cpu" or torch.cuda.is_available():  # a CUDA scaler disables itself without CUDA
        assert p.grad_scaler().is_enabled() is scaling


def test_this_machine():
    """The policy of the real device: float32 on CPU; on a GPU bf16 from sm80 on, else fp16 with loss scaling."""
    p = precision_policy()
    if torch.cuda.is_available():
        expected = torch.bfloat16 if torch.cuda.get_device_capability() >= (8, 0) else torch.float16
    else:
        expected = torch.float32
    assert device_caps().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert p.compute_dtype == expected and p.loss_scaling is (expected == torch.float16)
    assert precision_policy("cpu").compute_dtype == torch.float32
    row = p.as_row()
    assert row["precision_compute_dtype"] == str(expected).removeprefix("torch.")
    assert row["precision_grad_dtype"] == "float32"


def test_cpu_policy_runs_a_training_step_in_float32():
    """The policy's autocast/scaler wrap an actor step; everything the optimizer touches stays float32."""
    p = precision_policy(CPU)
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = p.grad_scaler()
    batch = create_dummy_batch(batch_size=4, num_unique_prompts=2, prompt_len=6, response_len=3, vocab_size=256)
    with p.autocast():
        lp = DeduplicatedActor(model=model).forward(batch).log_probs
    scaler.scale(-lp.sum()).backward()
    scaler.step(opt)
    scaler.update()
    check_float32_state(model, opt)
    assert opt.state and all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_cpu_autocast_to_bf16_keeps_master_weights():
    """A bf16 policy (faked on CPU, where autocast bf16 runs too): matmuls in bf16, parameters
    and their gradients still float32."""
    p = precision_policy(A100)
    p = dataclasses.replace(p, device_type="cpu")
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    batch = create_dummy_batch(batch_size=4, num_unique_prompts=2, prompt_len=6, response_len=3, vocab_size=256)
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with p.autocast():
        lp = DeduplicatedActor(model=model).forward(batch).log_probs
    hook.remove()
    assert seen == [torch.bfloat16]
    lp.sum().backward()
    check_float32_state(model)


def test_check_refuses_low_precision_state():
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="master weights in float32"):
        check_float32_state(model)
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters())
    p = next(model.parameters())
    opt.state[p] = {"exp_avg": torch.zeros(3, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="optimizer state"):
        check_float32_state(model, opt)
    for q in model.parameters():  # frozen parameters are not the optimizer's business
        q.requires_grad_(False)
    check_float32_state(model.to(torch.bfloat16))


@pytest.mark.parametrize("split,backend", [(True, "sdpa"), (True, "reference"), (False, None)])
def test_autocast_dedup_close_to_baseline(split, backend):
    """Under the bf16 policy's autocast (run on CPU), the hook gets mixed q/k/v dtypes (Qwen3's
    float32-weighted q_norm/k_norm) and casts them like autocast casts SDPA's inputs: dedup and
    the packed baseline agree to bf16 noise, and stay close to the float32 result."""
    from zorro_core import BaselineActor

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32, attn_implementation="sdpa")
    batch = create_dummy_batch(
        batch_size=6, num_unique_prompts=2, prompt_len=16, response_len=8, vocab_size=256, vary_lengths=True, seed=8
    )
    kw = dict(use_split_attention=split, varlen_backend=backend) if split else dict(use_split_attention=False)
    full = BaselineActor(model=model).forward(batch).log_probs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = DeduplicatedActor(model=model, **kw).forward(batch).log_probs
        b = BaselineActor(model=model, **kw).forward(batch).log_probs
    # measured: ~1e-3 for both (bf16 noise); a wrong mask or position is > 1
    assert (d - b).abs().max().item() < 2e-2
    assert (d - full).abs().max().item() < 2e-2
