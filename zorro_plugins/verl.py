"""verl's plugin entry point (group "verl.plugins", loaded on `import verl` in every process).

verl's V1 driver picks its trainer with `get_trainer_cls(config.trainer.v1.trainer_mode)` before any
`external_lib` is imported, so "zorro_sync" must be in verl's registry when `verl.trainer.ppo.v1` is
first imported. Loading this module only arranges that: once `verl.trainer.ppo.v1` has executed,
`zorro_core.integrations.verl.trainer` is imported and registers the name. Until then nothing of
zorro (or of verl: verl is mid-import when this runs) is imported.
"""

from __future__ import annotations

import importlib
import logging

from zorro_plugins.hooks import after_import

TRIGGER = "verl.trainer.ppo.v1"
"""The module whose import makes the zorro trainer importable (and registers it)."""

_log = logging.getLogger(__name__)


def register_trainer_name() -> None:
    """Import the zorro trainer, which registers its name with verl (a failure is logged, not raised:
    verl's own trainers must stay usable)."""
    try:
        importlib.import_module("zorro_core.integrations.verl.trainer")
    except Exception as e:  # noqa: BLE001 - any failure here must not break verl's import
        _log.warning("zorro: the verl trainer 'zorro_sync' is not registered: %s", e)


def install() -> None:
    """Idempotent: register now if verl's V1 package is already imported, else after it is."""
    after_import(TRIGGER, register_trainer_name)


install()
