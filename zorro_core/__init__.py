"""zorro: compute each shared prompt once in RL post-training, with equal log-probs and gradients."""

from zorro_core.actor.actor import BaselineActor, DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.output import ActorOutput
from zorro_core.plan.batch import RolloutBatch, create_dummy_batch
from zorro_core.plan.build import build_dedup_plan, build_plain_plan
from zorro_core.plan.prompt import PromptPlan
from zorro_core.plan.protocol import Plan
from zorro_core.plan.segments import Segments
from zorro_core.plan.trie import TriePlan

__all__ = [
    "ActorConfig",
    "ActorOutput",
    "BaselineActor",
    "DeduplicatedActor",
    "PromptPlan",
    "Plan",
    "TriePlan",
    "build_plain_plan",
    "RolloutBatch",
    "Segments",
    "build_dedup_plan",
    "create_dummy_batch",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # DedupPlan named the baseline's plan as well: it is PromptPlan now; the old name is kept for one release.
    if name == "DedupPlan":
        import warnings

        warnings.warn(
            "zorro_core.DedupPlan is now zorro_core.PromptPlan (removed after 2027-06-01)",
            DeprecationWarning,
            stacklevel=2,
        )
        return PromptPlan
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
