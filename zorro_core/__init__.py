"""zorro: compute each shared prompt once in RL post-training, with equal log-probs and gradients."""

from zorro_core.core.actor import ActorOutput, BaselineActor, DeduplicatedActor
from zorro_core.core.batch import RolloutBatch, create_dummy_batch
from zorro_core.core.plan import DedupPlan, Segments, build_dedup_plan

__all__ = [
    "ActorOutput",
    "BaselineActor",
    "DeduplicatedActor",
    "DedupPlan",
    "RolloutBatch",
    "Segments",
    "build_dedup_plan",
    "create_dummy_batch",
]
__version__ = "0.1.0"
