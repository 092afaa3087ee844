"""What this machine can run: versions, devices, attention backends, model families and the
optimization stack, as plain data (`zorro env` prints it; every results sidecar records it)."""

from __future__ import annotations

import platform
from typing import Optional

import torch
import transformers

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.self_check import SelfCheckVerdict, verdict_of
from zorro_core.attention.backends import BACKENDS, backend_unavailable
from zorro_core.models.presets import build_model, preset_config
from zorro_core.models.registry import FAMILIES, family_support
from zorro_core.plan.batch import create_dummy_batch
from zorro_core.stack.auto import choose_attention
from zorro_core.stack.liger import liger_unavailable
from zorro_core.stack.lora import LoraSettings, lora_unavailable
from zorro_core.stack.precision import precision_policy


def environment() -> dict:
    """Versions, devices and backend availability, as plain data (also written beside results)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "device": device,
        "varlen_backends": {n: backend_unavailable(n, device) or "ok" for n in BACKENDS},
        "model_types": sorted(FAMILIES),
        "model_families": family_support(device),
    }
    info.update(stack_support(device))
    for pkg in ("flash_attn", "liger_kernel", "fla", "peft"):
        try:
            mod = __import__(pkg)
            info[pkg] = getattr(mod, "__version__", "installed")
        except Exception:
            info[pkg] = None
    return info


def stack_support(device: str) -> dict:
    """The precision policy, the "auto" attention choice, and Liger/LoRA/QLoRA, on this machine."""
    policy = precision_policy(device)
    choice = choose_attention(device, policy.compute_dtype, None)
    scaling = "dynamic loss scaling" if policy.loss_scaling else "no loss scaling"
    return {
        "precision": f"{str(policy.compute_dtype).removeprefix('torch.')} compute, {scaling}, "
        f"float32 weights/grads/optimizer state ({policy.reason})",
        "attn auto": f"{choice.implementation} ({choice.reason})",
        "liger": liger_unavailable("qwen3", device) or "ok",
        "lora": lora_unavailable(None, device) or "ok",
        "qlora": lora_unavailable(LoraSettings(quantize_base="nf4"), device) or "ok",
    }


def self_check_probe(device: str | torch.device, varlen_backend: Optional[str] = None) -> SelfCheckVerdict:
    """The actor's self-check run on this machine (`zorro env`; zorro_core.actor.self_check):
    tiny-qwen3 with random weights in the device's compute dtype (bfloat16 on CUDA, float32 on CPU),
    its default split-mode backend (`flash_cpu`, the GPU path's code, on CPU), 2 prompts x 3 responses."""
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(preset_config("tiny-qwen3"), dtype=dtype, device=device)
    backend = varlen_backend or ("flash_cpu" if device.type == "cpu" else None)
    actor = DeduplicatedActor(model=model, varlen_backend=backend, self_check=False)
    batch = create_dummy_batch(6, 2, 24, 8, vocab_size=model.config.vocab_size, device=device, vary_lengths=True)
    return verdict_of(actor, batch)
