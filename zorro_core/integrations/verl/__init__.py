"""verl: what a user imports, by verl release. Imports no verl (the balance imports without it).

verl 0.8 and newer (tested: 0.9.1):

- `zorro_core.integrations.verl.engine`: `DedupFSDPEngine`, verl's FSDP engine whose forward step runs
  the deduplicated actor; the module to name in `actor_rollout_ref.model.external_lib`
  (`install(zorro_config=...)` from a module of your own sets the actor's options).
- `zorro_core.integrations.verl.trainer`: `DedupPPOTrainerSync`, verl's sync V1 trainer with whole
  prompt groups on each rank (`trainer.v1.trainer_mode=zorro_sync`; registered by `plugin`, the
  "verl.plugins" entry point).
- `zorro_core.integrations.verl.cpu` (and `cpu_vllm`): zorro's CPU platform for verl, for tests and CI.

The engine's parts: `rows` (a micro-batch read as zorro's rows), `batching` (dynamic micro-batches),
`metrics` ("zorro/..." entries), `balance` (whole groups per rank, pure Python), `needs` (the verl
version check).

verl <= 0.7 (legacy workers): `zorro_core.integrations.verl.legacy.patch_dp_actor`. Its names
(`patch_dp_actor`, `forward_micro_batch`, ...) are still read from this package, which was that
module before, with a DeprecationWarning (removed after 2027-06-01).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from zorro_core.integrations.deprecated import REMOVAL

_LEGACY = (
    "LEGACY_MAX",
    "REQUIRED_KEYS",
    "ZorroFallbackWarning",
    "check_legacy_verl",
    "check_micro_batch",
    "forward_micro_batch",
    "patch_dp_actor",
    "unserved_reason",
    "verl_position_ids",
)
"""What `zorro_core.integrations.verl` (the legacy module, now `legacy`) exported."""


def __getattr__(name: str) -> Any:
    if name not in _LEGACY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    new = "zorro_core.integrations.verl.legacy"
    warnings.warn(
        f"{__name__}.{name} moved to {new}.{name} (the old path is removed after {REMOVAL})",
        DeprecationWarning,
        stacklevel=2,
    )
    legacy = importlib.import_module(new)
    # The warning class kept its object and took a new name (core.DedupFallbackWarning).
    return legacy.DedupFallbackWarning if name == "ZorroFallbackWarning" else getattr(legacy, name)
