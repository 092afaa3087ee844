"""ActorConfig: every option of the actors, in one frozen, documented place.

The actors, the bench's cases, `zorro verify`, and the TRL and verl integrations all take an
ActorConfig, so an option is added here once. The actors also accept the same names as keyword
arguments (`DeduplicatedActor(model=m, sharing="prefix")`), which override the config's fields.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from zorro_core.actor.logprobs import LOGITS_MODES
from zorro_core.models.moe import AUX_WEIGHTINGS
from zorro_core.plan.sharing import DEFAULT_MIN_SHARED_TOKENS, SHARINGS, check_sharing

VARLEN_BACKENDS = ("reference", "sdpa", "flash_cpu", "torch_varlen", "flash_attn", "flash_cpu_gather")
"""The names `varlen_backend` takes (zorro_core.attention.backends.BACKENDS has one backend of each)."""
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "auto")
"""The names `attn_implementation` takes, besides any name registered in transformers' AttentionInterface."""

SCHEDULES = ("micro_batch", "prompt_once", "auto")
"""The actor's steps (zorro_core.actor.schedule): within micro-batches, each prompt once per step, or
per step the one of the two zorro_core.actor.auto chooses."""


def _registered_attention() -> list[str]:
    """The attention names transformers knows here (its own and any registered with AttentionInterface)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return list(ALL_ATTENTION_FUNCTIONS.valid_keys())


def _check_choice(name: str, value: Any, allowed: tuple[str, ...], none_ok: bool, more: tuple[str, ...] = ()) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, str) and (value in allowed or value in more):
        return
    choices = ", ".join(map(repr, allowed)) + (" or None" if none_ok else "")
    raise ValueError(f"ActorConfig.{name} must be one of {choices}; got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class ActorConfig:
    """How an actor computes log-probs. Defaults are the exact, general choices."""

    use_split_attention: bool = True
    """Split mode (a causal and a cross varlen call per layer) if True; mask mode (one attention over
    the packed row with the plan's block mask, eager/sdpa/flex_attention) if False."""
    attn_implementation: Optional[str] = None
    """The attention implementation: None keeps the model's own; "auto" picks from device, dtype and
    `max_seq_len` (zorro_core.stack.auto); or a transformers name ("sdpa", "flash_attention_2", ...)."""
    varlen_backend: Optional[str] = None
    """Split mode's varlen backend (zorro_core.attention.backends.BACKENDS); None: the default for the
    attention implementation and device."""
    logits_mode: str = "compute"
    """"compute": logits of response positions only; "memory": the same in chunks, recomputed in
    backward; "none": logits of every packed token (the plain computation's cost)."""
    logits_chunk_size: Optional[int] = None
    """Rows per chunk in "memory" mode; None: from `logits_memory_budget_mib`, else the default."""
    logits_memory_budget_mib: Optional[float] = None
    """"memory" mode: MiB one chunk's temporaries may take, from which the chunk size follows (> 0)."""
    router_aux_weighting: str = "multiplicity"
    """MoE router aux loss: "multiplicity" weights each packed token by its rows (equals the
    baseline's loss); "unique" counts each packed token once."""
    max_seq_len: Optional[int] = None
    """Longest prompt + response the actor will see, for attn_implementation="auto" (None: assumed long)."""
    sharing: str = "prompt"
    """"prompt": rows with identical prompts share them; "prefix": a token trie over whole rows."""
    min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS
    """sharing="prefix": shared runs shorter than this are not split off (>= 1)."""
    self_check: Optional[bool] = None
    """The deduplicated actor's first-call self-check against the plain computation on a slice of the
    batch (zorro_core.actor.self_check; falls back to a right path on a mismatch). None: on for a
    CUDA device, off on CPU (CI proves the CPU paths against float64); True/False: on/off."""

    schedule: str = "micro_batch"
    """How a step's micro-batches run where zorro owns the step (`forward_backward` without its own
    `schedule=`, verl's engine): "micro_batch" shares a prompt within each micro-batch;
    "prompt_once" computes each unique prompt once per step however many micro-batches its
    responses take (zorro_core.actor.schedule; docs/schedule.md); "auto" takes "prompt_once" for a
    step where it computes fewer FLOPs and its counted peak is at most the within path's at the same
    budget, else "micro_batch" (zorro_core.actor.auto; the output's `schedule_choice` says why)."""

    def __post_init__(self) -> None:
        """Every field's type and choices, checked here once: ValueError naming the field and what it takes.
        numpy numbers are taken as the equal int or float (stored as plain ones, for results files)."""
        for name in ("logits_chunk_size", "max_seq_len", "min_shared_tokens", "logits_memory_budget_mib"):
            value = getattr(self, name)
            if isinstance(value, np.generic):  # np.int64(4) -> 4, np.float32(8.0) -> 8.0, then checked below
                object.__setattr__(self, name, value.item())
        if not isinstance(self.use_split_attention, bool):
            raise ValueError(
                f"ActorConfig.use_split_attention must be True or False (split or mask mode); got "
                f"{type(self.use_split_attention).__name__} {self.use_split_attention!r}"
            )
        attn = self.attn_implementation
        if not (isinstance(attn, str) and attn in ATTN_IMPLEMENTATIONS):
            _check_choice("attn_implementation", attn, ATTN_IMPLEMENTATIONS, True, more=tuple(_registered_attention()))
        _check_choice("varlen_backend", self.varlen_backend, VARLEN_BACKENDS, True)
        _check_choice("logits_mode", self.logits_mode, LOGITS_MODES, False)
        _check_choice("router_aux_weighting", self.router_aux_weighting, AUX_WEIGHTINGS, False)
        _check_choice("schedule", self.schedule, SCHEDULES, False)
        if not isinstance(self.sharing, str):
            _check_choice("sharing", self.sharing, SHARINGS, False)
        budget = self.logits_memory_budget_mib
        if budget is not None and not (
            isinstance(budget, (int, float)) and not isinstance(budget, bool) and math.isfinite(budget) and budget > 0
        ):
            raise ValueError(f"logits_memory_budget_mib must be a finite number > 0, got {budget!r}")
        for name in ("logits_chunk_size", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        check_sharing(self.sharing, self.min_shared_tokens)
        if self.self_check is not None and not isinstance(self.self_check, bool):
            raise ValueError(f"ActorConfig.self_check must be True, False or None; got {self.self_check!r}")

    def replace(self, **options: Any) -> ActorConfig:
        """A copy with `options` changed; an unknown option is refused with the known ones."""
        unknown = sorted(set(options) - FIELDS)
        if unknown:
            raise TypeError(f"unknown actor option(s) {unknown}; ActorConfig has {sorted(FIELDS)}")
        return dataclasses.replace(self, **options) if options else self

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (for results files and reports)."""
        return dataclasses.asdict(self)


FIELDS = frozenset(f.name for f in dataclasses.fields(ActorConfig))
"""The option names an actor accepts as keyword arguments."""


def resolve_config(config: Optional[ActorConfig], options: dict[str, Any]) -> ActorConfig:
    """`config` (default: ActorConfig()) with keyword `options` applied over it; None values of
    `min_shared_tokens` mean its default (the actors' keyword API allowed it)."""
    if config is not None and not isinstance(config, ActorConfig):
        raise TypeError(f"config must be an ActorConfig, got {type(config).__name__}")
    if options.get("min_shared_tokens", 0) is None:
        options = {**options, "min_shared_tokens": DEFAULT_MIN_SHARED_TOKENS}
    return (config or ActorConfig()).replace(**options)
