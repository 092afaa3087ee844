"""The pass rule of `zorro verify gradients` and its verdicts: a case, its errors, its result.

Shared by the text cases (zorro_core.verify.gradients) and the vision cases (zorro_core.verify.vision),
which `zorro verify gradients` runs side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from zorro_core.actor.config import ActorConfig
from zorro_core.plan.dtypes import DTYPES as TORCH_DTYPES
from zorro_core.verify.tolerances import AUX_RTOL, GRAD_RTOL, LOGPROB_ATOL, LOW_PRECISION_FACTOR

# The float64 floors and the low-precision allowance (zorro_core.verify.tolerances), by the names
# the pass rule uses.
LP_FLOOR = LOGPROB_ATOL
GRAD_FLOOR = GRAD_RTOL
FACTOR = LOW_PRECISION_FACTOR
TEMPERATURE = 0.7

# The dtypes verify proves, in zorro_core.plan.dtypes' names.
DTYPES = {name: TORCH_DTYPES[name] for name in ("float64", "float32", "bfloat16")}
LAYOUTS = ("padded", "unpadded")
MODES = ("split", "mask")
ATTNS = ("eager", "sdpa", "flash_attention_2")
# GPU varlen kernels that take 16-bit inputs only (float32/float64 cases skip there).
HALF_ONLY_BACKENDS = {"flash_attn", "torch_varlen"}

RULE = (
    "Pass rule. Every case runs the deduplicated actor (dedup) and the baseline actor (same "
    "backend, no dedup) and compares both with each sequence run alone through the unmodified "
    "model in float64 on the same weights (ref64). "
    f"float64: |log-prob - ref64| <= {LP_FLOOR:g} and |entropy - ref64| <= {LP_FLOOR:g} on every "
    f"token, and ||grad - ref64|| / ||ref64|| <= {GRAD_FLOOR:g} for every parameter (the measured "
    "float64 floor, ~6e-8 and ~6e-7, with margin). "
    "float32/bfloat16: the dtype's own noise is the baseline's error against ref64; dedup passes "
    f"when its error against ref64 is <= {FACTOR:g} x the baseline's + the float64 floor, for the "
    "max log-prob error, the max entropy error and each parameter's gradient error. "
    "A case that cannot run here (a backend needs a GPU) is skipped with the reason; an error "
    "counts as a failure."
)


@dataclass(frozen=True)
class VerifyCase:
    """One configuration to prove: a model, a dtype, a batch layout, and the options both actors run with."""

    model: str
    """Preset name (tiny shapes of a supported family)."""
    dtype: str
    """float64, float32 or bfloat16."""
    layout: str
    """padded (varied prompt and response lengths, a lone row, a prefix prompt) or unpadded (equal lengths);
    "images" for a vision model (zorro_core.verify.vision's batches: several images per prompt, ...)."""
    actor: ActorConfig
    """The actors' options: attn_implementation (eager, sdpa, flash_attention_2), use_split_attention
    (two varlen calls, or one masked attention over the packed row), logits_mode (none, compute,
    memory), and the dedup actor's sharing and min_shared_tokens."""

    @property
    def name(self) -> str:
        a = self.actor
        mode = "split" if a.use_split_attention else "mask"
        if a.use_split_attention and a.varlen_backend:
            mode = f"split:{a.varlen_backend}"
        return f"{self.model}/{a.attn_implementation}/{self.dtype}/{self.layout}/{mode}/{a.logits_mode}"


@dataclass
class Errors:
    """One actor's errors against ref64."""

    log_prob: float
    """max |log-prob - ref| over real tokens."""
    entropy: float
    """max |entropy - ref| over real tokens."""
    grads: dict[str, float]
    """||grad - ref|| / ||ref|| per parameter."""
    aux: Optional[float] = None
    """The schedule mode's MoE cases: max |aux loss - ref| / ref over the micro-batches (None: not computed)."""

    @property
    def worst_param(self) -> tuple[str, float]:
        if not self.grads:
            return "", 0.0
        name = max(self.grads, key=lambda p: self.grads[p])
        return name, self.grads[name]


@dataclass
class CaseResult:
    """The verdict of one case."""

    case: VerifyCase
    status: str
    """pass, fail, skip or error."""
    reason: str = ""
    """Why it failed, was skipped or errored."""
    dedup: Optional[Errors] = None
    baseline: Optional[Errors] = None
    dedup_vs_baseline: float = float("nan")
    """max |dedup log-prob - baseline log-prob|."""
    worst_ratio: float = float("nan")
    """max over checks of dedup error / its tolerance (> 1 fails)."""
    worst_check: str = ""
    """Which check has that ratio."""
    seconds: float = 0.0
    self_check: str = ""
    """The actor's self-check on the case's batch (zorro_core.actor.self_check): "pass", "fail" or
    "error", then ": " and its numbers; "" where it does not run (CPU sdpa/reference paths)."""

    def to_dict(self) -> dict:
        """Plain data for JSON (nan and inf become None, so the output is strict JSON)."""
        f = finite_or_none
        d = {
            "case": self.case.name,
            "model": self.case.model,
            "dtype": self.case.dtype,
            "layout": self.case.layout,
            "actor": self.case.actor.as_dict(),
            "status": self.status,
            "reason": self.reason,
            "dedup_vs_baseline_log_prob": f(self.dedup_vs_baseline),
            "worst_ratio": f(self.worst_ratio),
            "worst_check": self.worst_check,
            "seconds": round(self.seconds, 3),
            "self_check": self.self_check,
        }
        for who, e in (("dedup", self.dedup), ("baseline", self.baseline)):
            if e is not None:
                name, err = e.worst_param
                d[who] = {
                    "log_prob_err": f(e.log_prob),
                    "entropy_err": f(e.entropy),
                    "worst_param": name,
                    "worst_param_rel_err": f(err),
                    "grad_rel_err": {k: f(v) for k, v in e.grads.items()},
                }
                if e.aux is not None:
                    d[who]["aux_loss_rel_err"] = f(e.aux)  # type: ignore[index]
        return d


def finite_or_none(x: float) -> Optional[float]:
    """x, or None for nan/inf (strict JSON has neither)."""
    return x if math.isfinite(x) else None


def judge(dtype: str, dedup: Errors, baseline: Errors, factor: float = FACTOR) -> tuple[float, str, list[str]]:
    """Apply RULE: (worst error/tolerance ratio, its check, the failing checks with figures)."""
    low = dtype != "float64"

    def tol(base_err: float, floor: float) -> float:
        return factor * base_err + floor if low else floor

    checks = [
        ("log-prob", dedup.log_prob, tol(baseline.log_prob, LP_FLOOR)),
        ("entropy", dedup.entropy, tol(baseline.entropy, LP_FLOOR)),
    ]
    checks += [(f"grad {n}", e, tol(baseline.grads.get(n, 0.0), GRAD_FLOOR)) for n, e in dedup.grads.items()]
    if dedup.aux is not None:
        checks.append(("aux loss", dedup.aux, tol(baseline.aux or 0.0, AUX_RTOL)))
    worst, worst_name, failing = 0.0, "", []
    for name, err, limit in checks:
        ratio = err / limit if math.isfinite(err) else math.inf
        if ratio > worst or not worst_name:
            worst, worst_name = ratio, name
        if not ratio <= 1.0:
            failing.append(f"{name} {err:.2e} > {limit:.2e}")
    return worst, worst_name, failing
