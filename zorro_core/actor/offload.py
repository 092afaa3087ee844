"""Phase 1's dormant activations on the host: the prompt-once schedule's prompts' graph between its
phase 1 and phase 3 (zorro_core.actor.schedule).

Phase 1 keeps the prompts' graph until phase 3, and phase 2 never reads it. `HostOffload` holds
every tensor that graph saves on the host instead. It uses PyTorch's own mechanism,
`torch.autograd.graph.saved_tensors_hooks`, as `save_on_cpu` does, with two changes that
`save_on_cpu` cannot make:
- the parameters stay where they are (a layer's weight saved for its input's gradient is not copied);
- on a CPU device the host copy is a real copy (`save_on_cpu` would hand back the same tensor), so
  the tests on CPU run what a GPU runs.
On CUDA the copy goes to pinned memory, non-blocking on the current stream, and each tensor comes
back when phase 3's backward unpacks it, layer by layer. The copies are not on a side stream and do
not overlap phase 2.

What it does not move: the kept keys and values and the first-token hidden states (leaves phase 2
reads in every micro-batch), and, under non-reentrant gradient checkpointing, the layer inputs
(checkpoint keeps them itself, not as saved tensors).

On or off (`offload_by_count`): forced by the caller, or by the count when the caller says nothing.
By the count it is on where the device is CUDA and the counted graph of the wave's phase 1 is
larger than that of its largest response micro-batch, so that the dormant part is the larger one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class HostOffload:
    """saved_tensors_hooks' pack and unpack for phase 1 (module doc); counts what it moved."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.copies = 0
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.numel() == 0 or t.untyped_storage().data_ptr() in self.params:
            return t  # a weight (or nothing): stays where it is
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
        else:
            host = t.detach().clone()  # a real copy on CPU too
        self.copies += 1
        self.bytes += host.numel() * host.element_size()
        return (t.device, host)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def offload_by_count(actor: Any, wave_tokens: int, response_tokens: list[int], asked: Optional[bool]) -> bool:
    """Whether a wave offloads phase 1's graph: `asked` when given, else by the count (module doc)."""
    if asked is not None:
        return asked
    if actor.device.type != "cuda" or not torch.is_grad_enabled():
        return False
    from zorro_core.actor.self_check import compute_dtype
    from zorro_core.actor.token_bytes import TokenBytes, checkpointing_on
    from zorro_core.models.registry import model_shape

    tb = TokenBytes.of(
        model_shape(actor.model.config), compute_dtype(actor), checkpointing_on(actor.model), actor.config.logits_mode
    )
    return tb.resident(wave_tokens) > max(tb.graph(r) for r in response_tokens)
