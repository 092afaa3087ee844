"""LoRA through peft, QLoRA (4-bit NF4 base) through bitsandbytes: dedup on adapter-wrapped models.

peft injects its adapter layers in place of the decoder's nn.Linear projections, so the
actors drive a PeftModel like any causal LM: models.parts.model_parts unwraps it (unwrap_adapters)
to the underlying model, whose decoder now contains the adapters; the attention hook, the
plan and the log-prob path are unchanged, and only the adapter weights receive gradients.

Limits (refused, not ignored): an adapter on lm_head (the log-prob path reads lm_head as a
plain nn.Linear); lora_dropout > 0 in training mode (each copy of a prompt would draw its own
mask, so the dedup forward could not equal the baseline; models.parts.check_trainable_state).
QLoRA needs a CUDA GPU and bitsandbytes; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from zorro_core.models.parts import model_parts

# The projections of every supported family (attention and dense MLP).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraSettings:
    """A LoRA adapter, in the terms of peft.LoraConfig."""

    r: int = 16
    """Rank of the update B @ A."""
    alpha: int = 32
    """Scale numerator: the update is multiplied by alpha / r."""
    dropout: float = 0.0
    """lora_dropout; > 0 is refused by the dedup path in training mode (per-copy masks)."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Module names that get an adapter; never lm_head."""
    init_lora_weights: bool = True
    """peft's init: True starts B at zero (the adapter is the identity); False random (tests)."""
    quantize_base: Optional[str] = None
    """None, or "nf4": QLoRA, the frozen base linears in 4-bit NF4 (bitsandbytes, CUDA only)."""

    def __post_init__(self) -> None:
        if self.r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout must be in [0, 1), got {self.dropout}")
        if "lm_head" in self.target_modules:
            raise ValueError("an adapter on lm_head is not supported by the dedup log-prob path")
        if self.quantize_base not in (None, "nf4"):
            raise ValueError(f"quantize_base must be None or 'nf4', got {self.quantize_base!r}")


def lora_unavailable(settings: Optional[LoraSettings] = None, device: str | torch.device = "cpu") -> Optional[str]:
    """Why `settings` cannot run on `device` here, or None when it can."""
    if importlib.util.find_spec("peft") is None:
        return "peft is not installed (pip install 'zorro[lora]')"
    if settings is not None and settings.quantize_base == "nf4":
        if torch.device(device).type != "cuda":
            return f"QLoRA (4-bit NF4 base) needs a CUDA GPU (got {torch.device(device).type})"
        if importlib.util.find_spec("bitsandbytes") is None:
            return "QLoRA needs bitsandbytes (pip install 'zorro[gpu]')"
    return None


def quantize_nf4(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace the decoder's nn.Linear layers with frozen 4-bit NF4 ones (bitsandbytes), in place.

    lm_head stays as it is (the log-prob path reads its weight). Fused MoE expert weights are
    not nn.Linear and stay unquantized. The model must be on a CUDA device.
    """
    device = next(model.parameters()).device
    why = lora_unavailable(LoraSettings(quantize_base="nf4"), device)
    if why:
        raise ValueError(why)
    import bitsandbytes as bnb  # lazy: optional package, checked above

    base = model_parts(model).base
    for parent in list(base.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=compute_dtype,
                compress_statistics=True,
                quant_type="nf4",
            )
            # Params4bit quantizes when it is moved to the GPU.
            q.weight = bnb.nn.Params4bit(
                child.weight.data.to("cpu", compute_dtype),
                requires_grad=False,
                compress_statistics=True,
                quant_type="nf4",
            )
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data.to(compute_dtype), requires_grad=False)
            setattr(parent, name, q.to(device))
    model.is_loaded_in_4bit = True  # type: ignore[assignment]  # a plain flag peft reads to treat the model as quantized
    return model


def apply_lora(
    model: nn.Module, settings: Optional[LoraSettings] = None, compute_dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """Wrap a causal LM with a LoRA adapter (QLoRA: quantize the base first); returns the PeftModel.

    Base weights are frozen; the adapter weights are the only trainable parameters (float32
    when the base is low precision: peft's autocast_adapter_dtype, the precision policy's
    master weights).
    """
    settings = settings or LoraSettings()
    device = next(model.parameters()).device
    why = lora_unavailable(settings, device)
    if why:
        raise ValueError(why)
    from peft import LoraConfig, get_peft_model  # lazy: optional package, checked above

    model_parts(model)  # refuse an unsupported model before wrapping it
    if settings.quantize_base == "nf4":
        quantize_nf4(model, compute_dtype)
    config = LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        init_lora_weights=settings.init_lora_weights,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters an optimizer would update (for a LoRA model: the adapter weights)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
