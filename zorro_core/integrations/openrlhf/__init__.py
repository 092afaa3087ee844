"""OpenRLHF: `DedupActor`, a drop-in `openrlhf.models.Actor`, and `install()` for OpenRLHF's Ray trainer.

    from zorro_core.integrations.openrlhf import DedupActor, install, serve_critic

Those names live in `zorro_core.integrations.openrlhf.actor` and are loaded (with OpenRLHF) on first
use, so that the package's OpenRLHF-free parts, `rows` (a row's prompt/response split) and `status`
(the "zorro/..." logger entries), import without OpenRLHF; `batching` is zorro's batching in OpenRLHF's
trainer. A missing or too old OpenRLHF is refused when one of the actor's names is read, with the
install command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zorro_core.integrations.core import DedupFallbackWarning
from zorro_core.integrations.deprecated import renamed

if TYPE_CHECKING:
    from zorro_core.integrations.openrlhf.actor import (
        TESTED_OPENRLHF,
        DedupActor,
        RowSplit,
        check_openrlhf,
        grouped_experience_maker,
        install,
        split_rows,
        status_trainer,
    )
    from zorro_core.integrations.openrlhf.critic import serve_critic

__all__ = [
    "TESTED_OPENRLHF",
    "DedupActor",
    "DedupFallbackWarning",
    "RowSplit",
    "check_openrlhf",
    "grouped_experience_maker",
    "install",
    "serve_critic",
    "split_rows",
    "status_trainer",
]
_CRITIC = frozenset({"serve_critic"})
"""The names of `critic` this package gives (what docs/openrlhf.md imports from here)."""
_ACTOR = frozenset(__all__) - {"DedupFallbackWarning"} - _CRITIC
"""The names of `actor` this package gives (what `zorro_core.integrations.openrlhf` exported as one module)."""

_old_names = renamed(__name__, {"ZorroFallbackWarning": "DedupFallbackWarning"}, globals())


def __getattr__(name: str) -> Any:
    if name in _ACTOR:
        return getattr(importlib.import_module("zorro_core.integrations.openrlhf.actor"), name)
    if name in _CRITIC:
        return getattr(importlib.import_module("zorro_core.integrations.openrlhf.critic"), name)
    return _old_names(name)
