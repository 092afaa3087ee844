"""TRL: `DedupGRPOTrainer`, a drop-in `trl.GRPOTrainer` whose log-probs go through zorro.

    from zorro_core.integrations.trl import DedupGRPOTrainer

The trainer is in `zorro_core.integrations.trl.trainer`; importing this package imports it (and
TRL), so a missing or too old TRL is refused here, with the install command.
"""

from __future__ import annotations

from zorro_core.integrations.deprecated import renamed
from zorro_core.integrations.trl.trainer import (
    TESTED_TRL,
    DedupFallbackWarning,
    DedupGRPOTrainer,
    check_trl_version,
    prompt_dedup_ratio,
)

__all__ = ["TESTED_TRL", "DedupFallbackWarning", "DedupGRPOTrainer", "check_trl_version", "prompt_dedup_ratio"]
__getattr__ = renamed(__name__, {"ZorroFallbackWarning": "DedupFallbackWarning"}, globals())
