"""verl's plugin entry point (group "verl.plugins", loaded on `import verl` in every process).

verl's V1 driver picks its trainer with `get_trainer_cls(config.trainer.v1.trainer_mode)` inside
the Ray task runner before any `external_lib` is imported, so a trainer name must already be in
verl's registry when `verl.trainer.ppo.v1` is first imported. This module only arranges that:
once `verl.trainer.ppo.v1` has executed, `zorro_core.integrations.verl_trainer` is imported and
registers "zorro_sync". It imports nothing of verl itself (verl is mid-import when it runs),
registers no engine and changes nothing for a job that does not select "zorro_sync".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

TRIGGER = "verl.trainer.ppo.v1"
"""The module whose import makes the zorro trainer importable (and registers it)."""

_log = logging.getLogger(__name__)


def register_trainer_name() -> None:
    """Import the zorro trainer, which registers its name with verl (a failure is logged, not raised:
    verl's own trainers must stay usable)."""
    try:
        importlib.import_module("zorro_core.integrations.verl_trainer")
    except Exception as e:  # noqa: BLE001 - any failure here must not break verl's import
        _log.warning("zorro: the verl trainer 'zorro_sync' is not registered: %s", e)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        register_trainer_name()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds `TRIGGER` with the other finders and runs `register_trainer_name` after it executes."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != TRIGGER:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Idempotent: register now if verl's V1 package is already imported, else after it is."""
    if TRIGGER in sys.modules:
        register_trainer_name()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


install()
