"""The integrations' old module paths and class names, kept for one release with a DeprecationWarning.

Each old module (`zorro_core.integrations.verl_engine`, ...) is a one-line shim calling `moved`: it
warns naming the new path and puts the new module itself in `sys.modules` under the old name, so the
old path gives the very objects of the new one (one engine registry, one `_INSTALLED` table, patches
through either name reach the same module). `MOVED` is also the one table that treats an old name
and its new one alike where a name is data: verl's `external_lib` (`verl.engine.config_for`).
`renamed` is the PEP 562 `__getattr__` of a module whose class got a new name (`Zorro...` -> `Dedup...`,
the trainer class it replaces).

Imports no trainer: importable wherever zorro_core is.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any, Callable, Mapping

__all__ = ["MOVED", "REMOVAL", "canonical", "moved", "renamed"]

REMOVAL = "2027-06-01"
"""The date after which the old paths and names are removed."""

_P = "zorro_core.integrations."
MOVED: Mapping[str, str] = {
    _P + old: _P + new
    for old, new in {
        "verl_engine": "verl.engine",
        "verl_trainer": "verl.trainer",
        "verl_balance": "verl.balance",
        "verl_batching": "verl.batching",
        "verl_rows": "verl.rows",
        "verl_metrics": "verl.metrics",
        "verl_plugin": "verl.plugin",
        "verl_cpu": "verl.cpu",
        "verl_cpu_vllm": "verl.cpu_vllm",
        "needs_verl": "verl.needs",
        "openrlhf_batching": "openrlhf.batching",
        "openrlhf_rows": "openrlhf.rows",
        "openrlhf_status": "openrlhf.status",
    }.items()
}
"""Old module path -> new module path."""


def canonical(module: str) -> str:
    """The current path of a module named by its old or its new path (any other name unchanged)."""
    return MOVED.get(module, module)


def moved(old: str) -> None:
    """Called by the shim module `old`: warn, then make `old` the new module itself in `sys.modules`
    (the import system hands out what `sys.modules` holds once the shim has run)."""
    new = MOVED[old]
    # stacklevel 3: past this function and the shim's body (the import system's frames are skipped).
    warnings.warn(
        f"{old} moved to {new} (the old path is removed after {REMOVAL})",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)


def renamed(module: str, names: Mapping[str, str], namespace: Mapping[str, Any]) -> Callable[[str], Any]:
    """A module `__getattr__` answering each old name in `names` (old -> new) with the object the
    module holds under the new name, with a DeprecationWarning naming the new one."""

    def __getattr__(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is now {new} (the old name is removed after {REMOVAL})", DeprecationWarning, stacklevel=2
        )
        return namespace[new]

    return __getattr__
