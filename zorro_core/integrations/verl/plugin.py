"""verl's plugin entry point (group "verl.plugins", loaded on `import verl` in every process).

verl's V1 driver picks its trainer with `get_trainer_cls(config.trainer.v1.trainer_mode)` inside
the Ray task runner before any `external_lib` is imported, so a trainer name must already be in
verl's registry when `verl.trainer.ppo.v1` is first imported. This module only arranges that:
once `verl.trainer.ppo.v1` has executed, `zorro_core.integrations.verl.trainer` is imported and
registers "zorro_sync". It imports nothing of verl itself (verl is mid-import when it runs),
registers no engine and changes nothing for a job that does not select "zorro_sync".

`after_import` is the same hook for other modules (`cpu` uses it), and `vllm_cpu_plugin` is
vLLM's plugin entry point for zorro's CPU test platform (a no-op unless `VERL_PLATFORM=cpu`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

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


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, callbacks: list[Callable[[], None]]):
        self._inner = inner
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for callback in self._callbacks:
            callback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders and runs their callbacks after they execute."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[], None]]] = {}

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        callbacks = self.callbacks.get(fullname)
        if not callbacks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, callbacks)
                return spec
        return None


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Run `callback` once `module` has executed: now if it already has, else right after its import
    (one finder on `sys.meta_path` for all watched modules)."""
    if module in sys.modules:
        callback()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _AfterImport)), None)
    if finder is None:
        finder = _AfterImport()
        sys.meta_path.insert(0, finder)
    callbacks = finder.callbacks.setdefault(module, [])
    if callback not in callbacks:
        callbacks.append(callback)


def install() -> None:
    """Idempotent: register now if verl's V1 package is already imported, else after it is."""
    after_import(TRIGGER, register_trainer_name)


def vllm_cpu_plugin() -> None:
    """vLLM's general plugin (group "vllm.general_plugins", run in every vLLM process): on zorro's CPU
    test platform for verl (`VERL_PLATFORM=cpu`) it loads `cpu_vllm`; otherwise it returns at
    once and loads nothing."""
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != "cpu":
        return
    importlib.import_module("zorro_core.integrations.verl.cpu_vllm")


install()
