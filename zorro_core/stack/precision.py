"""Precision policy: what a device computes in, and what stays in float32.

- GPU with bfloat16 (compute capability >= 8.0): autocast to bf16, no loss scaling (bf16 has
  float32's exponent range, so small gradients do not underflow).
- Older GPU: autocast to fp16 with dynamic loss scaling (torch.amp.GradScaler): fp16's range
  is narrow, and unscaled gradients below ~6e-8 flush to zero.
- CPU: float32 throughout (CPU autocast speeds nothing up on most CPUs and loses accuracy).
Always: parameters ("master weights"), their gradients and the optimizer state in float32;
only the forward's matmuls run in the low-precision dtype (autocast), so an update smaller
than a bf16 ulp of the weight is not lost.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

# bf16 tensor-core support starts at Ampere (sm80); flash-attn 2 needs the same.
BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class DeviceCaps:
    """What a device offers, as plain data (tests build fakes of it)."""

    type: str
    """"cuda" or "cpu"."""
    name: str = ""
    """Device name, e.g. "NVIDIA A100-SXM4-40GB"."""
    capability: Optional[tuple[int, int]] = None
    """CUDA compute capability (major, minor); None on CPU."""

    @property
    def bf16(self) -> bool:
        return self.type == "cuda" and self.capability is not None and tuple(self.capability) >= BF16_MIN_CAPABILITY


def device_caps(device: str | torch.device | None = None) -> DeviceCaps:
    """The capabilities of `device` (default: cuda when available, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceCaps(type=device.type, name="cpu")
    if not torch.cuda.is_available():
        raise ValueError("a CUDA device was asked for but torch.cuda.is_available() is False")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return DeviceCaps(
        type="cuda", name=torch.cuda.get_device_name(index), capability=torch.cuda.get_device_capability(index)
    )


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes a training step uses on one device, and why."""

    device_type: str
    """"cuda" or "cpu": the autocast device type."""
    compute_dtype: torch.dtype
    """dtype of the forward's matmuls (autocast target); float32 means no autocast."""
    loss_scaling: bool
    """Whether the loss is scaled (dynamic GradScaler): fp16 only."""
    param_dtype: torch.dtype = torch.float32
    """Master weights: parameters stay float32."""
    grad_dtype: torch.dtype = torch.float32
    """Gradients accumulate in float32 (they are the parameters' dtype)."""
    optimizer_state_dtype: torch.dtype = torch.float32
    """Optimizer moments in float32 (Adam's second moment underflows in bf16/fp16)."""
    reason: str = ""
    """Why this policy was chosen on this device."""

    def autocast(self):
        """Context manager for the forward: autocast to compute_dtype, or nothing in float32."""
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A dynamic loss scaler; disabled (scale() and step() pass through) unless loss_scaling."""
        return torch.amp.GradScaler(self.device_type, enabled=self.loss_scaling)

    def as_row(self) -> dict:
        """Flat fields for a result row."""
        d = asdict(self)
        return {
            f"precision_{k}": (str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v) for k, v in d.items()
        }


def precision_policy(caps: DeviceCaps | str | torch.device | None = None) -> PrecisionPolicy:
    """The policy for a device (or its DeviceCaps)."""
    if not isinstance(caps, DeviceCaps):
        caps = device_caps(caps)
    if caps.type != "cuda":
        return PrecisionPolicy(
            caps.type,
            torch.float32,
            False,
            reason=f"{caps.type}: float32 throughout (no fast low-precision matmul to gain)",
        )
    cc = "sm%d%d" % tuple(caps.capability) if caps.capability else "unknown capability"
    if caps.bf16:
        return PrecisionPolicy(
            "cuda",
            torch.bfloat16,
            False,
            reason=f"{caps.name or 'GPU'} ({cc}) has bf16: autocast bf16, no loss scaling (float32 exponent range)",
        )
    return PrecisionPolicy(
        "cuda",
        torch.float16,
        True,
        reason=f"{caps.name or 'GPU'} ({cc}) has no bf16: autocast fp16 with dynamic loss scaling",
    )


def check_float32_state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> None:
    """Refuse trainable parameters, gradients or optimizer state that are not float32.

    Quantized (4-bit) base weights are frozen and not checked: only what the optimizer updates is.
    """
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dtype != torch.float32:
            raise ValueError(
                f"trainable parameter {name} is {p.dtype}; the precision policy keeps master weights in float32"
            )
        if p.grad is not None and p.grad.dtype != torch.float32:
            raise ValueError(f"gradient of {name} is {p.grad.dtype}; the precision policy keeps gradients in float32")
    if optimizer is not None:
        for state in optimizer.state.values():
            for key, v in state.items():
                if torch.is_tensor(v) and v.is_floating_point() and v.dtype != torch.float32:
                    raise ValueError(f"optimizer state {key!r} is {v.dtype}; the precision policy keeps it in float32")
