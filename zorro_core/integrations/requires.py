"""The trainer an integration needs, checked before any of the trainer's names is imported.

Each integration module calls `require_trainer` first: it imports the trainer's top package
only, and refuses a missing trainer (with the install command of zorro's extra) or a release
older than the module reproduces (naming the version found), so that the user reads that, not
"cannot import name 'GRPOConfig'" or "No module named 'verl.utils'" from an import below.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from types import ModuleType
from typing import Optional

from packaging.version import InvalidVersion, Version


def install_hint(extra: str) -> str:
    """How to install the trainer an integration needs, through zorro's extra of that name."""
    return f'pip install -e ".[{extra}]" (in a zorro checkout; or pip install "zorro[{extra}]")'


def require_trainer(package: str, reader: str, extra: str, needs: str, minimum: Optional[str] = None) -> ModuleType:
    """The trainer's top package `package`, imported alone. ModuleNotFoundError (name=`package`)
    when it is not installed, ImportError when its version is older than `minimum`; both name
    `reader` (the integration module), `needs` (as "TRL 1.15 or 1.16") and the install hint."""
    try:
        module = importlib.import_module(package)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != package:
            raise
        raise ModuleNotFoundError(
            f"{reader} needs {needs}, which is not installed: {install_hint(extra)}", name=package
        ) from None
    found = installed_version(package, module)
    if minimum is not None and found is not None:
        try:
            older = Version(found) < Version(minimum)
        except InvalidVersion:
            older = False
        if older:
            raise ImportError(f"{reader} needs {needs} (found {found}): {install_hint(extra)}", name=package)
    return module


def installed_version(package: str, module: Optional[ModuleType] = None) -> Optional[str]:
    """The version of the installed `package`: its `__version__`, else its distribution's metadata."""
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
