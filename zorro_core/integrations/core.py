"""What every trainer integration shares: which rows hold the same prompt, the record of the calls
the trainer's own computation served, and the checks of what an integration reads of a trainer
beyond its public API.

- `prompt_groups` (zorro_core.plan.prompt, the function the plans group rows with) is the one
  answer to "rows with the same prompt" for every integration; `grouped_order` and
  `prompt_dedup_ratio` are read from it.
- `Fallback`: one per trainer object (a TRL trainer, an OpenRLHF actor, a verl engine); a call the
  dedup path does not serve is counted and its reason warned once per object
  (`DedupFallbackWarning`), a served one counted. Its `counts` is the trainers' `zorro_calls`.
- `require_attributes` / `require_parameters` / `require_assigned`: run at import on the trainer's classes (and, for what
  a trainer sets on its instances, once per instance), so that a trainer release that renamed a
  private attribute fails with the attribute's name and the tested versions instead of running
  another computation.

Imports no trainer: importable wherever zorro_core is.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Optional, Sequence

import torch

from zorro_core.integrations.deprecated import renamed
from zorro_core.plan.prompt import prompt_groups

__all__ = [
    "DedupFallbackWarning",
    "Fallback",
    "grouped_order",
    "prompt_dedup_ratio",
    "prompt_groups",
    "refuse_schedule",
    "require_assigned",
    "require_attributes",
    "require_parameters",
]
# The old names of the renamed classes (Zorro... -> Dedup..., the trainer class each replaces).
__getattr__ = renamed(__name__, {"ZorroFallbackWarning": "DedupFallbackWarning"}, globals())


class DedupFallbackWarning(UserWarning):
    """The dedup path does not serve a trainer's call; the trainer's own computation ran instead."""


def grouped_order(prompts: torch.Tensor, prompt_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A stable permutation of the rows putting rows with the same prompt next to each other, groups
    in order of first appearance."""
    return torch.sort(prompt_groups(prompts, prompt_mask), stable=True).indices


def prompt_dedup_ratio(prompts: torch.Tensor, prompt_mask: torch.Tensor) -> float:
    """1 - prompt tokens computed once per distinct prompt / prompt tokens of the rows (0 for none)."""
    if prompts.shape[0] == 0:
        return 0.0
    lens = prompt_mask.bool().sum(1)
    total = int(lens.sum())
    if not total:
        return 0.0
    group = prompt_groups(prompts, prompt_mask)
    unique = int(lens.new_zeros(int(group.max()) + 1).scatter(0, group, lens).sum())
    return 1.0 - unique / total


class Fallback:
    """The calls of one trainer object: served by zorro ("dedup") or by the trainer ("fallback").

    `served_by` names what runs instead, e.g. "verl's own forward serves this micro-batch"; each
    reason is warned once per `Fallback` (`DedupFallbackWarning`, "zorro: {served_by}: {reason}") and
    counted in `reasons`. `counts` is the dict the integrations expose as `zorro_calls`.
    """

    def __init__(self, served_by: str) -> None:
        self.served_by = served_by
        self.counts: dict[str, int] = {"dedup": 0, "fallback": 0}
        self.reasons: dict[str, int] = {}
        """Calls the trainer served, by reason."""
        self._warned: set[str] = set()

    def served(self) -> None:
        self.counts["dedup"] += 1

    def fall_back(self, reason: str) -> None:
        """Count a call the trainer serves itself; warn the first time this reason comes."""
        self.counts["fallback"] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        self._warn(reason, f"zorro: {self.served_by}: {reason}")

    def note(self, text: str) -> None:
        """Warn once of something that changes no call (e.g. an untested trainer release)."""
        self._warn(text, f"zorro: {text}")

    def has_fallen_back(self, prefix: str) -> bool:
        """Whether a call fell back for a reason starting with `prefix`."""
        return any(reason.startswith(prefix) for reason in self.reasons)

    def _warn(self, key: str, text: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(text, DedupFallbackWarning, stacklevel=4)


def _name(owner: Any) -> str:
    if inspect.ismodule(owner):
        return owner.__name__
    cls = owner if inspect.isclass(owner) else type(owner)
    return f"{cls.__module__}.{cls.__qualname__}"


def require_attributes(owner: Any, names: Sequence[str], trainer: str, tested: str, reader: str) -> None:
    """Raise ImportError naming each of `names` that `owner` (a class, module or instance) lacks.

    `trainer` is the installed release ("verl 0.9.1"), `tested` the tested ones ("verl 0.9.1"),
    `reader` the zorro module or class that reads them.
    """
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        raise ImportError(
            f"{trainer}: {_name(owner)} has no {', '.join(missing)}, which {reader} reads (tested with {tested}); "
            f"this release changed what zorro relies on, so {reader} is not used with it"
        )


def require_parameters(
    function: Callable[..., Any], names: Sequence[str], trainer: str, tested: str, reader: str
) -> None:
    """Raise ImportError unless `function`'s leading parameters are `names` (its signature as tested)."""
    have = tuple(inspect.signature(function).parameters)[: len(names)]
    if have != tuple(names):
        raise ImportError(
            f"{trainer}: {function.__qualname__} has parameters {have}, not {tuple(names)} as in {tested}; "
            f"{reader} cannot rely on it"
        )


def require_assigned(
    cls: type, methods: Sequence[str], names: Sequence[str], trainer: str, tested: str, reader: str
) -> None:
    """Raise ImportError naming each of `names` (instance attributes) that none of `cls`'s `methods`
    (e.g. its constructor) uses: an attribute a trainer sets on its instances cannot be looked up on
    the class, so its constructor's code is read instead (the instance is checked again once built)."""
    used: set[str] = set()
    for method in methods:
        code = getattr(getattr(cls, method, None), "__code__", None)
        if code is None:
            raise ImportError(
                f"{trainer}: {_name(cls)} has no method {method}, which {reader} relies on (tested with {tested})"
            )
        used.update(code.co_names)
    missing = [n for n in names if n not in used]
    if missing:
        raise ImportError(
            f"{trainer}: {_name(cls)}.{'/'.join(methods)} no longer set {', '.join(missing)}, which {reader} reads "
            f"(tested with {tested}); this release changed what zorro relies on, so {reader} is not used with it"
        )


def refuse_schedule(config: Any, trainer: str) -> None:
    """Refuse `ActorConfig(schedule="prompt_once")` in a trainer whose own loop runs the step's
    micro-batches (OpenRLHF, verl's legacy actor): zorro sees one micro-batch per call there, so the schedule would
    be silently ignored (docs/trainers.md, "The prompt-once schedule in OpenRLHF")."""
    if getattr(config, "schedule", "micro_batch") != "micro_batch":
        raise ValueError(
            f"ActorConfig(schedule={config.schedule!r}) is not served by {trainer}: its own loop runs the "
            "step's micro-batches one call at a time, so zorro never owns the step (docs/trainers.md, "
            "'The prompt-once schedule in OpenRLHF'); use schedule='micro_batch' here, or verl's "
            "engine or actor.forward_backward for the schedule"
        )
