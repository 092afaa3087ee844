"""ActorOutput: what an actor's forward returns, in the batch's [B, R] layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from zorro_core.plan.protocol import Plan


@dataclass
class ActorOutput:
    """Per-token results in the batch's [B, R] layout."""

    log_probs: torch.Tensor
    """[B, R] log-prob of each response token; 0 at padding; float32 (float64 for a float64 model)."""
    entropy: Optional[torch.Tensor]
    """[B, R] entropy of each predictive distribution, or None."""
    plan: Optional[Plan] = None
    """The plan used (None for the padded baseline)."""
    aux_loss: Optional[torch.Tensor] = None
    """Router load-balancing loss (MoE models with config.output_router_logits), else None.
    Counted per the actor's router_aux_weighting: "multiplicity" (default) equals the baseline's."""
