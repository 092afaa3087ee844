"""The self-check: the actor's path against the plain computation on the user's own hardware.

CI proves every path against the float64 per-sequence reference on CPU; a compiled kernel, a
driver or a torch build on the user's GPU is never in CI. So, on the first call for each key
(attention mode, varlen backend, attention implementation, compute dtype, plan kind) the actor
also computes a small slice of the batch (the rows of one prompt, at most SLICE_ROWS, cut to the
last SLICE_PROMPT_TOKENS prompt and the first SLICE_RESPONSE_TOKENS response tokens) three ways:

- the actor's own path (dedup, its backend): the one under test;
- the plain packed computation (every row its own group) on the `reference` backend (explicit
  softmax, the oracle of the backends): the right answer in this dtype;
- the same on the `sdpa` backend: a second right answer, whose distance to the first measures
  the dtype's own noise on this machine (low precision only).

Compared: every log-prob, and the gradient of a fixed random projection of them (one backward
each) with respect to the model's trainable vector parameters (norm scales, biases; all
trainable parameters when none is a vector, as under LoRA). Each layer's attention pre-norm
scale gets that layer's dq, dk and dv through its projections, and every layer's through the
residual stream, so a wrong attention backward anywhere shows, at O(layers x hidden) memory.

Rule (docs/correctness.md): float64 as the proof's floors (|log-prob| <= 1e-6, each parameter's
||grad - plain|| / ||plain|| <= 1e-5); lower precisions within FACTOR x the two right paths'
distance (the proof's "4x the baseline's own error", with the spread of two right computations in
place of a float64 copy the user cannot afford) plus the dtype's floor. A mismatch switches the
actor, for the rest of the run, to the next right path (a kernel pair or flex: `sdpa` split mode;
`sdpa`/`reference` themselves: the plain computation), which is checked in turn; a warning says
so once with the numbers. Across data-parallel ranks (torch.distributed initialised) the verdicts
are all-gathered and the worst taken, so every rank runs the same path. Models whose parameters
are sharded (FSDP, FSDP2 DTensors, DeepSpeed ZeRO-3) are not checked (said once): an extra backward
would enter the wrapper's gradient reduction.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from zorro_core.actor.config import ActorConfig
from zorro_core.attention.hook import RouteSpec
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.build import plan_type

__all__ = ["SelfCheck", "SelfCheckVerdict", "SelfCheckWarning", "verdict_of"]

SLICE_ROWS = 4
"""Rows of the slice: one prompt's (its responses share it), else the batch's first rows."""
SLICE_PROMPT_TOKENS = 64
"""Prompt tokens kept per row (the last ones: prompts are left-padded)."""
SLICE_RESPONSE_TOKENS = 16
"""Response tokens kept per row (the first ones)."""
LOGPROB_FLOOR = 1e-6
"""float64 floor of |log-prob difference| (zorro_core.verify.tolerances.LOGPROB_ATOL; a test holds them equal)."""
GRAD_FLOOR = 1e-5
"""float64 floor of a parameter's relative gradient difference (tolerances.GRAD_RTOL)."""
FACTOR = 4.0
"""Lower precisions: the allowance in units of the dtype's measured noise (tolerances.LOW_PRECISION_FACTOR)."""
EPS_UNITS = 2.0
"""Lower precisions: the noise is taken as at least this many units of the dtype's epsilon (relative
for gradients, absolute for log-probs): two right paths may round alike by chance."""
SEED = 20260
"""The random projection's seed (the same on every rank and every run)."""


class _Actor(Protocol):
    """What the self-check reads of an actor (zorro_core.actor.actor's are ones)."""

    model: torch.nn.Module
    device: torch.device
    config: ActorConfig
    dedup: bool
    route_spec: RouteSpec

    def run_route(self, batch: RolloutBatch, spec: RouteSpec, dedup: bool, temperature: float) -> torch.Tensor:
        """[B, R] log-probs of `batch` on `spec`, with dedup on or off."""


class SelfCheckWarning(RuntimeWarning):
    """The self-check found the actor's path wrong on this machine and switched to a right one."""


@dataclass(frozen=True)
class SelfCheckVerdict:
    """One key's comparison (the worst over the data-parallel ranks)."""

    key: tuple[str, ...]
    """(mode, backend, attention, dtype, plan kind)."""
    passed: bool
    logprob_error: float
    """max |log-prob - plain| over the slice's tokens."""
    logprob_allowed: float
    grad_error: float
    """The worst parameter's ||grad - plain|| / ||plain|| (0 when nothing is trainable)."""
    grad_allowed: float
    """That parameter's allowance."""
    parameter: str
    """The worst parameter (by error / allowance)."""
    seconds: float
    """This rank's time for the check (the three forward+backward passes of the slice)."""
    error: str = ""
    """What the checked path raised on this device ("" when it ran): a kernel that cannot run here
    fails its check like a wrong one, and the fallback takes over."""

    def describe(self) -> str:
        mode, backend, attention, dtype, kind = self.key
        if self.error:
            return f"{backend} ({mode} mode, {attention}, {dtype}, {kind}) raised {self.error}"
        return (
            f"{backend} ({mode} mode, {attention}, {dtype}, {kind}) against the plain computation: "
            f"log-prob error {self.logprob_error:.3g} (allowed {self.logprob_allowed:.3g}), gradient error "
            f"{self.grad_error:.3g} (allowed {self.grad_allowed:.3g}, {self.parameter or 'no trainable parameter'})"
        )


def fallback_of(spec: RouteSpec, dedup: bool) -> Optional[tuple[RouteSpec, bool]]:
    """The next right path after `spec` failed: split mode on sdpa for a kernel pair or a mask/flex
    path; the plain computation (no dedup, reference backend) for sdpa/reference; None after that."""
    if spec.mode == "split" and spec.backend in ("sdpa", "reference"):
        return (RouteSpec("split", "reference", spec.attention), False) if dedup else None
    return RouteSpec("split", "sdpa", spec.attention), dedup


def compute_dtype(actor: _Actor) -> torch.dtype:
    """What attention computes in: the autocast dtype when autocast is on, else the model's."""
    kind = actor.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return next(actor.model.parameters()).dtype


def key_of(actor: _Actor, spec: RouteSpec, dedup: bool) -> tuple[str, ...]:
    """(mode, backend, attention, compute dtype, plan kind): what one verdict covers."""
    kind = plan_type(dedup, actor.config.sharing).__name__ if dedup else "plain"
    return (spec.mode, spec.backend, spec.attention, str(compute_dtype(actor)).split(".")[-1], kind)


class SelfCheck:
    """One actor's self-checks: the verdict of each key, and the path the actor runs."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.verdicts: dict[tuple[str, ...], SelfCheckVerdict] = {}
        self.skipped: Optional[str] = None
        """Why the model is not checked (sharded parameters), once known."""
        self.failed: Optional[SelfCheckVerdict] = None
        """The first failing verdict; the actor then runs `spec`/`dedup` below."""
        self.spec: Optional[RouteSpec] = None
        self.dedup: Optional[bool] = None
        self.exchange = True
        """All-gather the verdicts over the ranks (`agree`). An integration whose ranks decide per call
        whether zorro serves it (OpenRLHF) turns it off: one rank handing a call back would leave the
        others waiting in the exchange, while two right paths on two ranks meet no collective in an
        unsharded forward (sharded models are not checked)."""

    def metric(self) -> Optional[float]:
        """`zorro/self_check`: 1.0 every check passed, 0.0 one failed (the actor fell back), None none ran."""
        if self.failed is not None:
            return 0.0
        return 1.0 if self.verdicts else None

    def route(
        self, actor: _Actor, batch: RolloutBatch, spec: RouteSpec, dedup: bool, temperature: float
    ) -> tuple[RouteSpec, bool]:
        """The (spec, dedup) the actor runs this call with: its own once checked right, else the fallback."""
        if self.spec is not None and self.dedup is not None:
            spec, dedup = self.spec, self.dedup
        if not self.enabled or self.skipped is not None:
            return spec, dedup
        while True:
            key = key_of(actor, spec, dedup)
            if key[-1] == "plain" and spec.backend == "reference":
                return spec, dedup  # the plain computation on the oracle backend is what others are checked against
            verdict = self.verdicts.get(key)
            if verdict is None:
                why = sharded(actor.model)
                if why:
                    self.skipped = why
                    warnings.warn(f"zorro: the self-check is skipped: {why}", SelfCheckWarning, stacklevel=4)
                    return spec, dedup
                verdict = check(actor, batch, spec, dedup, temperature, key)
                verdict = self.verdicts[key] = agree(verdict, actor.device) if self.exchange else verdict
            if verdict.passed:
                return spec, dedup
            nxt = fallback_of(spec, dedup)
            if nxt is None:
                raise RuntimeError(
                    f"zorro: the self-check failed on the plain computation itself: {verdict.describe()}"
                )
            if self.failed is None:
                self.failed = verdict
                warnings.warn(
                    f"zorro: self-check failed, {verdict.describe()}. Falling back for the rest of the run to "
                    f"{'split mode on ' + nxt[0].backend if nxt[1] else 'the plain computation (no dedup)'}.",
                    SelfCheckWarning,
                    stacklevel=4,
                )
            spec, dedup = self.spec, self.dedup = nxt


def sharded(model: torch.nn.Module) -> Optional[str]:
    """Why an extra backward through `model` is not safe here, or None."""
    for p in model.parameters():
        if type(p).__name__ == "DTensor" or hasattr(p, "ds_id") or getattr(p, "_is_flat_param", False):
            return "the model's parameters are sharded (FSDP / DeepSpeed ZeRO-3)"
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return "the model's parameters are sharded (FSDP)"
    return None


def slice_of(batch: RolloutBatch) -> RolloutBatch:
    """The check's rows (module doc): the first live row's prompt group, else the first live rows; trimmed."""
    live = batch.response_mask.bool().any(1)  # rows with a response token (a check needs log-probs)
    first = int(live.nonzero().flatten()[0])
    p, m = batch.prompts, batch.prompt_mask.bool()
    same = ((p == p[first]) | ~(m | m[first])).all(1) & (m == m[first]).all(1)
    rows = (same & live).nonzero().flatten()[:SLICE_ROWS]
    if rows.numel() < 2:
        rows = live.nonzero().flatten()[:SLICE_ROWS]
    pm = batch.prompt_mask[rows][:, -SLICE_PROMPT_TOKENS:]
    keep_p = pm.bool().any(0).nonzero().flatten()
    pm = pm[:, int(keep_p[0]) :] if keep_p.numel() else pm
    prompts = batch.prompts[rows][:, -pm.shape[1] :]
    responses = batch.responses[rows][:, :SLICE_RESPONSE_TOKENS]
    rm = batch.response_mask[rows][:, :SLICE_RESPONSE_TOKENS]
    return RolloutBatch(prompts.clone(), pm.clone(), responses.clone(), rm.clone())


def _vectors(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    vectors = [(n, p) for n, p in trainable if p.dim() <= 1]
    return vectors or trainable


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode for the check (dropout is refused in training anyway; eval sidesteps gradient
    checkpointing, whose reentrant flavour cannot take `autograd.grad`), each module's mode restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def _run(actor: _Actor, batch: RolloutBatch, spec: RouteSpec, dedup: bool, temperature: float, params):
    lp = actor.run_route(batch, spec, dedup, temperature)
    # the log-probs live on the model's device, the batch may not (the actor moves it; found on an H200)
    mask = batch.response_mask.to(lp.device).bool()
    if not params:
        return lp.detach(), []
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(lp.shape, generator=g, dtype=torch.float64).to(device=lp.device, dtype=lp.dtype)
    grads = torch.autograd.grad((lp * w * mask).sum(), [p for _, p in params], allow_unused=True)
    return lp.detach(), [torch.zeros_like(p) if gr is None else gr.detach() for (_, p), gr in zip(params, grads)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = float(b.norm())
    err = float((a - b).norm())
    return err / denom if denom > 0 else err


def check(
    actor: _Actor,
    batch: RolloutBatch,
    spec: RouteSpec,
    dedup: bool,
    temperature: float,
    key: tuple[str, ...],
    under_test: Optional[Callable] = None,
) -> SelfCheckVerdict:
    """This rank's comparison of `spec` against the plain computation on a slice of `batch` (module doc).

    `under_test(part, params) -> (log-probs, grads)` replaces `spec`'s run as the path checked (the
    prompt-once schedule's, zorro_core.actor.schedule): the same projection, loss and comparison."""
    start = time.perf_counter()
    dtype = compute_dtype(actor)
    with torch.inference_mode(False), torch.enable_grad(), _eval_mode(actor.model):
        part = slice_of(batch)
        params = _vectors(actor.model)
        try:
            if under_test is not None:
                lp, grads = under_test(part, params)
            else:
                lp, grads = _run(actor, part, spec, dedup, temperature, params)
        except torch.OutOfMemoryError:
            raise  # the device's memory, not the path: the fallback would meet it too
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here (its signature, this GPU) fails the check
            if under_test is None and fallback_of(spec, dedup) is None:
                raise  # the plain computation itself: nothing to fall back to, the trainer sees its error
            seconds = time.perf_counter() - start
            return SelfCheckVerdict(key, False, math.inf, 0.0, math.inf, 0.0, "", seconds, f"{type(e).__name__}: {e}")
        mask = part.response_mask.to(lp.device).bool()
        lp_ref, grads_ref = _run(
            actor, part, RouteSpec("split", "reference", spec.attention), False, temperature, params
        )
        lp_err = float((lp - lp_ref).double().abs()[mask].max())
        errs = [_rel(a, b) for a, b in zip(grads, grads_ref)]
        if dtype == torch.float64:
            lp_allowed, allowed = LOGPROB_FLOOR, [GRAD_FLOOR] * len(errs)
        else:
            lp_sdpa, grads_sdpa = _run(
                actor, part, RouteSpec("split", "sdpa", spec.attention), False, temperature, params
            )
            eps = torch.finfo(dtype).eps * EPS_UNITS
            noise_lp = max(float((lp_sdpa - lp_ref).double().abs()[mask].max()), eps)
            lp_allowed = FACTOR * noise_lp + LOGPROB_FLOOR
            allowed = [FACTOR * max(_rel(a, b), eps) + GRAD_FLOOR for a, b in zip(grads_sdpa, grads_ref)]
    worst = max(range(len(errs)), key=lambda i: errs[i] / allowed[i], default=None)
    grad_err = errs[worst] if worst is not None else 0.0
    grad_allowed = allowed[worst] if worst is not None else GRAD_FLOOR
    passed = math.isfinite(lp_err) and lp_err <= lp_allowed and all(e <= a for e, a in zip(errs, allowed))
    passed = passed and all(math.isfinite(e) for e in errs)
    name = params[worst][0] if worst is not None else ""
    seconds = time.perf_counter() - start
    return SelfCheckVerdict(key, passed, lp_err, lp_allowed, grad_err, grad_allowed, name, seconds)


def agree(verdict: SelfCheckVerdict, device: torch.device) -> SelfCheckVerdict:
    """The worst verdict over the data-parallel ranks (all-gathered when torch.distributed is
    initialised; every rank makes the same first calls, so every rank gathers here)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return verdict
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    figures = [
        0.0 if verdict.passed else 1.0,
        verdict.logprob_error,
        verdict.logprob_allowed,
        verdict.grad_error,
        verdict.grad_allowed,
    ]
    mine = torch.tensor(figures, dtype=torch.float64, device=on)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    failing = [i for i, t in enumerate(every) if t[0] > 0]
    if not failing or dist.get_rank() in failing:
        return verdict
    _, lp_err, lp_allowed, grad_err, grad_allowed = every[failing[0]].tolist()
    parameter = f"rank {failing[0]}'s worst parameter"
    return SelfCheckVerdict(verdict.key, False, lp_err, lp_allowed, grad_err, grad_allowed, parameter, verdict.seconds)


def verdict_of(actor: _Actor, batch: RolloutBatch, temperature: float = 1.0) -> SelfCheckVerdict:
    """The self-check of `actor`'s own path on `batch`, agreed over the ranks, without switching the
    actor (what `zorro verify gradients` reports beside its proof)."""
    spec, dedup = actor.route_spec, actor.dedup
    return agree(check(actor, batch, spec, dedup, temperature, key_of(actor, spec, dedup)), actor.device)
