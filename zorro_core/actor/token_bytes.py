"""The prompt-once schedule's and the within-micro-batch path's peaks, counted per token from the
cost model's ModelShape (what schedule="auto" and the offload rule compare: zorro_core.actor.auto,
zorro_core.actor.offload).

Per decoder layer and token it counts the layer's input, the attention's query, keys, values and
output, the post-attention norm's input and the MLP's gate, up and product (the tensors
flash-attention-style kernels and a gated MLP save), and the logits in the actor's logits mode. It
is a count, not a measurement: `zorro bench memory --budget` counts the same paths by running them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from zorro_core.plan.cost import ModelShape


@dataclass(frozen=True)
class TokenBytes:
    """Bytes a token costs, counted from the model's shape (module doc)."""

    layer: float
    """What one decoder layer saves for backward per token."""
    layer_input: float
    """One layer's input per token (all a checkpointed layer keeps)."""
    layers: int
    """Decoder layers."""
    kept: float
    """The kept keys and values per prompt token, every attention layer (their gradients as many)."""
    logits: float
    """Per position that gets logits: the logits and their float32 log-softmax."""
    checkpointing: bool
    """Every decoder layer checkpointed."""

    @classmethod
    def of(cls, shape: ModelShape, dtype: torch.dtype, checkpointing: bool, logits_mode: str) -> "TokenBytes":
        e = torch.empty((), dtype=dtype).element_size()
        h, v_dim = shape.hidden_size, shape.value_head_dim
        q = shape.num_heads * shape.head_dim
        kv = shape.num_kv_heads * (shape.head_dim + v_dim)
        if shape.moe_layers:
            mlp = shape.experts_per_token * shape.moe_intermediate_size + shape.shared_intermediate_size
        else:
            mlp = shape.intermediate_size
        layer = e * (2 * h + q + kv + shape.num_heads * v_dim + 3 * mlp)
        attention_layers = shape.num_layers - shape.num_linear_layers
        logits = 0.0 if logits_mode == "memory" else shape.vocab_size * (e + 4)
        return cls(layer, e * h, shape.num_layers, e * kv * attention_layers, logits, checkpointing)

    def graph(self, tokens: int) -> float:
        """A forward's graph held until its backward (checkpointed: the layer inputs and one layer re-made)."""
        if self.checkpointing:
            return tokens * (self.layers * self.layer_input + self.layer)
        return tokens * self.layers * self.layer

    def resident(self, tokens: int) -> float:
        """Phase 1's graph held through phase 2 (checkpointed: the layer inputs only)."""
        return tokens * self.layers * (self.layer_input if self.checkpointing else self.layer)


def within_peak(tb: TokenBytes, tokens: Sequence[int], logit_positions: Sequence[int]) -> float:
    """The within path's counted peak: its largest micro-batch's graph and logits."""
    return max(tb.graph(t) + p * tb.logits for t, p in zip(tokens, logit_positions))


def schedule_peak(
    tb: TokenBytes, wave_tokens: Sequence[int], chunk_tokens: Sequence[int], response_tokens: Sequence[int]
) -> float:
    """The schedule's counted peak: the largest wave's residents (its graph, the kept keys and values
    and their gradients) with one response micro-batch (its graph and logits), or in phase 3 under
    checkpointing one layer of its largest phase-1 chunk re-made."""
    resident = max(tb.resident(p) + 2 * p * tb.kept for p in wave_tokens)
    micro = max(tb.graph(r) + r * tb.logits for r in response_tokens)
    phase3 = max(chunk_tokens) * tb.layer if tb.checkpointing else 0.0
    return resident + max(micro, phase3)


def checkpointing_on(model: Any) -> bool:
    """Whether transformers checkpoints the model's decoder layers (either API name)."""
    from zorro_core.models.parts import unwrap_adapters

    lm = unwrap_adapters(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5.x, 4.x
        if hasattr(type(lm), name) or hasattr(lm, name):
            return bool(getattr(lm, name))
    return False
