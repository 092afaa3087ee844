"""Imported first by the engine-era verl integrations (engine, cpu, trainer), before
any of verl's names: a missing verl, or one older than they read, is refused here with the
version found and the install command (zorro_core.integrations.requires)."""

from __future__ import annotations

from zorro_core.integrations.requires import require_trainer

VERL_MINIMUM = "0.8"
"""The first verl release without the legacy workers, the oldest these modules read
(zorro_core.integrations.verl.legacy serves the legacy ones); 0.9.1 is the tested one."""

verl = require_trainer(
    "verl",
    "zorro's verl integration (zorro_core.integrations.verl: engine, cpu, trainer)",
    "verl",
    f"verl >= {VERL_MINIMUM} (tested: 0.9.1)",
    minimum=VERL_MINIMUM,
)
