"""The CLI's closed choices as Enums (typer lists them in --help and refuses anything else),
each built from the library's own tuple so the two cannot drift apart."""

from __future__ import annotations

from enum import Enum
from typing import Iterable

from zorro_core.actor.logprobs import LOGITS_MODES
from zorro_core.plan.sharing import SHARINGS
from zorro_core.verify.gradients import ATTNS, LAYOUTS
from zorro_harness.analyze.workload_sim import BATCHINGS
from zorro_harness.bench.report import METRICS
from zorro_harness.bench.suite import ATTN_IMPLEMENTATIONS, BASELINES, DTYPES, PHASES


def _choices(name: str, values: Iterable[str]) -> type[Enum]:
    return Enum(name, [(v, v) for v in values], type=str)


Attn = _choices("Attn", ATTN_IMPLEMENTATIONS)
VerifyAttn = _choices("VerifyAttn", ATTNS)  # what the verifiers run (verify gradients/training take lists of these)
LogitsMode = _choices("LogitsMode", LOGITS_MODES)
DType = _choices("DType", DTYPES)
Baseline = _choices("Baseline", BASELINES)
Phase = _choices("Phase", PHASES)
Metric = _choices("Metric", METRICS)
Layout = _choices("Layout", LAYOUTS)
Sharing = _choices("Sharing", SHARINGS)
Batching = _choices("Batching", BATCHINGS)  # zorro analyze --data


def value(choice: Enum | None) -> str | None:
    """The plain string of a choice (None stays None)."""
    return None if choice is None else choice.value
