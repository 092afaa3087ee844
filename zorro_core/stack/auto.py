"""attn_implementation="auto": flash-attn 2 where it pays and runs, sdpa otherwise, with the reason.

Flash Attention 2 is chosen when all of these hold, else sdpa (CPU: sdpa):
- a CUDA GPU of compute capability >= 8.0 (flash-attn 2 runs on Ampere and newer, the GPUs
  with bf16);
- the model computes in bf16 or fp16 (flash-attn has no float32 kernel);
- sequences longer than FLASH_MIN_SEQ_LEN tokens (below it sdpa is as fast and flash-attn's
  varlen bookkeeping does not pay); an unknown length is assumed long (RL rollouts are);
- split attention (mask mode runs eager or sdpa only);
- flash-attn >= MIN_FLASH_ATTN installed and importable, transformers >= MIN_TRANSFORMERS.
Every unmet condition is named in the reason, so a result row says why it ran what it ran.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Optional

import torch
import transformers
from packaging.version import Version

from zorro_core.stack.precision import DeviceCaps, device_caps

AUTO = "auto"
FLASH = "flash_attention_2"
FLASH_MIN_SEQ_LEN = 512
# 2.6: varlen with window_size and bottom-right causal alignment (zorro's cross segments).
MIN_FLASH_ATTN = "2.6"
BEYOND_FLASH_ATTN = "2.9"  # the first release zorro's varlen pair is not written for (zorro_core.attention.kernels)
# 4.44: flash_attention_2 with packed position_ids in transformers' own forward (padded baseline).
MIN_TRANSFORMERS = "4.44"


@dataclass(frozen=True)
class AttentionChoice:
    """The attention implementation an actor runs, and why."""

    implementation: str
    """"flash_attention_2", "sdpa" or "eager" (what the model and varlen backend use)."""
    reason: str
    """Why: the conditions met, or every one that was not."""
    auto: bool = False
    """Whether it was chosen by attn_implementation="auto" (else requested explicitly)."""

    def as_row(self) -> dict:
        """Fields for a result row."""
        return {"attn_choice": self.implementation, "attn_reason": self.reason, "attn_auto": self.auto}


def flash_attn_version() -> Optional[str]:
    """The installed and importable flash-attn version, or None."""
    try:
        version = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:  # a wheel built against another torch/CUDA installs fine and fails on import
        import flash_attn  # noqa: F401
    except Exception:
        return None
    return version


def transformers_version() -> str:
    return transformers.__version__


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def choose_attention(
    caps: DeviceCaps | str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    max_seq_len: Optional[int] = None,
    use_split_attention: bool = True,
) -> AttentionChoice:
    """Resolve "auto" for a device, the model's compute dtype and the longest prompt + response."""
    if max_seq_len is not None and max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    if not isinstance(caps, DeviceCaps):
        caps = device_caps(caps)
    if caps.type != "cuda":
        return AttentionChoice("sdpa", f"{caps.type}: flash-attn needs a CUDA GPU; sdpa", auto=True)
    unmet: list[str] = []
    met: list[str] = []
    cc = "sm%d%d" % tuple(caps.capability) if caps.capability else "unknown capability"
    (met if caps.bf16 else unmet).append(
        f"GPU {cc}" + ("" if caps.bf16 else " is older than sm80 (flash-attn 2 needs Ampere or newer)")
    )
    if dtype in (torch.bfloat16, torch.float16):
        met.append(_dtype_name(dtype))
    else:
        unmet.append(f"model dtype {_dtype_name(dtype)} (flash-attn runs bf16/fp16 only)")
    if max_seq_len is None:
        met.append(f"sequence length unknown, assumed > {FLASH_MIN_SEQ_LEN}")
    elif max_seq_len > FLASH_MIN_SEQ_LEN:
        met.append(f"{max_seq_len}-token sequences")
    else:
        unmet.append(f"sequences of at most {max_seq_len} tokens (<= {FLASH_MIN_SEQ_LEN}: sdpa is as fast)")
    if not use_split_attention:
        unmet.append("mask mode (use_split_attention=False) runs eager or sdpa")
    fa = flash_attn_version()
    if fa is None:
        unmet.append("flash-attn not installed or not importable (pip install 'zorro[gpu]')")
    elif Version(fa) < Version(MIN_FLASH_ATTN):
        unmet.append(f"flash-attn {fa} < {MIN_FLASH_ATTN}")
    elif Version(fa) >= Version(BEYOND_FLASH_ATTN):
        unmet.append(f"flash-attn {fa} >= {BEYOND_FLASH_ATTN} (zorro's varlen pair is written for 2.6 to 2.8.x)")
    else:
        met.append(f"flash-attn {fa}")
    tf = transformers_version()
    if Version(tf) < Version(MIN_TRANSFORMERS):
        unmet.append(f"transformers {tf} < {MIN_TRANSFORMERS}")
    else:
        met.append(f"transformers {tf}")
    if unmet:
        return AttentionChoice("sdpa", "sdpa: " + "; ".join(unmet), auto=True)
    return AttentionChoice(FLASH, "flash-attn 2: " + ", ".join(met), auto=True)


def resolve_attention(
    attn_implementation: Optional[str],
    device: str | torch.device | None,
    dtype: torch.dtype,
    max_seq_len: Optional[int] = None,
    use_split_attention: bool = True,
) -> AttentionChoice:
    """What an actor runs for its attn_implementation argument ("auto", a name, or None)."""
    if attn_implementation == AUTO:
        return choose_attention(device, dtype, max_seq_len, use_split_attention)
    if attn_implementation is None:
        return AttentionChoice("", "the model's own attention implementation")
    return AttentionChoice(attn_implementation, "requested explicitly")
