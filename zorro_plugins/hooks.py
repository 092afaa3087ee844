"""Run a callback right after a module executes: one finder on `sys.meta_path` for every watched module.

The finder asks the finders after it on `sys.meta_path` for the module's spec and wraps its loader
(those before it were asked already: asking them again would run another library's hook twice).
Another library's finder of the same shape (asking every other finder in turn) after this one would
ask this one back: a per-thread set of the names being looked up here breaks that cycle (the inner
call returns None, as wrapt's post-import hooks do), so the import goes on through the others.
Standard library only: this module is imported by the plugin entry points in every verl and vLLM
process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Sequence


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


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds the watched modules with the other finders and runs their callbacks after they execute."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callable[[], None]]] = {}
        self._busy = threading.local()

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        callbacks = self.callbacks.get(fullname)
        if not callbacks:
            return None
        busy: set[str] = self._busy.__dict__.setdefault("names", set())
        if fullname in busy:  # asked back by a finder this lookup is asking: let the others answer
            return None
        busy.add(fullname)
        try:
            for finder in _after(self, list(sys.meta_path)):
                if not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader, callbacks)
                    return spec
            return None
        finally:
            busy.discard(fullname)


def _after(me: object, finders: list) -> list:
    """The finders after `me` on sys.meta_path: the import system (or a finder before `me` that asks every
    other) asked those before already, and asking them again would run their hooks twice. Not on it: all."""
    at = next((i for i, f in enumerate(finders) if f is me), None)
    return finders[at + 1 :] if at is not None else [f for f in finders if f is not me]


def after_import(module: str, callback: Callable[[], None]) -> None:
    """Run `callback` once `module` has executed: now if it already has, else right after its import."""
    if module in sys.modules:
        callback()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, AfterImport)), None)
    if finder is None:
        finder = AfterImport()
        sys.meta_path.insert(0, finder)
    callbacks = finder.callbacks.setdefault(module, [])
    if callback not in callbacks:
        callbacks.append(callback)
