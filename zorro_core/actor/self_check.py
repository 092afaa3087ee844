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
place of a float64 copy the user cannot afford) plus the dtype's floor.

Gated DeltaNet layers (Qwen3-Next, Qwen3.5): their delta rule (transformers' chunked kernel, fla's)
computes in float32 whatever the model's dtype, and zorro's paths call it otherwise than the plain
computation does (a response's chunks start at its prompt's end, from the prompt's kept state), so
a right path differs from the plain one by that kernel's float32 rounding, which reaches O(1)
relative on a parameter whose gradient nearly cancels (A_log, dt_bias). Two comparisons then, both
against the plain computation with the delta rule in float64 (`_float64_delta_rule`): zorro's path
with the delta rule in float64 too, by the rule above per parameter (zorro's own computation, at
the floors in float64); and zorro's path with the model's own kernel, over all checked parameters
at once, within FACTOR x the distance of the plain computation with that kernel (the proof's "4x
the baseline's own error", the baseline carrying the kernel's noise): a kernel that mishandles
zorro's calls (its initial state, its varlen segments) is off by O(1). The worse one is reported.

A mismatch switches the actor, for the rest of the run, to the next right path (a kernel pair or
flex: `sdpa` split mode; `sdpa`/`reference` themselves: the plain computation), which is checked
in turn; a warning says so once with the numbers, or with what the path raised.

The model's own errors are not zorro's: when the checked path raises, the plain computation runs;
if it raises too, or a second try of the path does not (a transient error), the error reaches the
caller with a note, no verdict is recorded and the next call checks again. Likewise when the plain
computation itself gives non-finite values (NaN in the model's weights): nothing is judged, a
warning says so, the call runs on the actor's path. Only a path that disagrees with the plain
computation, or raises where it does not, falls back.

Across data-parallel ranks (torch.distributed initialised): at its first call each rank writes
its self_check setting to the process group's store (a write, not a collective), and a rank that
checks reads every rank's before its first verdict exchange: a rank with the check off would never
come to the exchange, so the rank that checks refuses with an error naming the setting and the
ranks instead of waiting. Then the verdicts, their figures and reasons, are all-gathered and the
worst taken, so every rank runs the same path (another rank's failure is reported by its reason
and names that rank). Models whose parameters are sharded (FSDP, FSDP2 DTensors, DeepSpeed ZeRO-3)
are not checked (said once): an extra backward would enter the wrapper's gradient reduction.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist

from zorro_core.actor.config import ActorConfig
from zorro_core.attention.hook import RouteSpec
from zorro_core.models.exact_delta_rule import chunk_gated_delta_rule_exact
from zorro_core.models.linear_attention import delta_rule_of, linear_layers
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
    """What the self-check tells the user: the actor's path was found wrong on this machine and a right
    one took over, the check was skipped (sharded parameters), or it judged nothing this call (the
    plain computation itself was not finite)."""


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
    """This rank's time for the check (the forward+backward passes of the slice)."""
    error: str = ""
    """What the checked path raised on this device where the plain computation did not ("" when it
    ran): a kernel that cannot run here fails its check like a wrong one, and the fallback takes over."""
    unjudged: str = ""
    """Why nothing was judged ("" when a verdict was reached): the model's own error (the plain
    computation raised too, or the error did not recur) or non-finite values of the plain computation.
    Such a verdict is not recorded: the next call checks again."""
    rank: Optional[int] = None
    """The data-parallel rank this verdict is from, when another rank's (`agree`)."""
    raised: Optional[BaseException] = field(default=None, compare=False, repr=False)
    """This rank's exception from the model's own code, raised to the caller once the ranks agreed."""

    @property
    def judged(self) -> bool:
        return not self.unjudged

    def describe(self) -> str:
        mode, backend, attention, dtype, kind = self.key
        where = f"on rank {self.rank}, " if self.rank is not None else ""
        what = f"{where}{backend} ({mode} mode, {attention}, {dtype}, {kind})"
        if self.unjudged:
            return f"{what} not judged: {self.unjudged}"
        if self.error:
            return f"{what} raised {self.error}"
        return (
            f"{what} against the plain computation: "
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
        self.registered = False
        """Whether this actor's first call was made (`register`)."""
        self.slot: Optional[str] = None
        """This actor's key in the process group's store (`register`), under torch.distributed."""
        self.setting_checked = False
        """Whether the ranks' settings were read (`_check_setting`, before the first verdict exchange)."""
        self.setting_refused = ""
        """Why the ranks' settings were refused (raised again at every later check)."""
        self.pending: Optional[BaseException] = None
        """This rank's model error to raise once the call's checks are made (`settle`)."""

    def metric(self) -> Optional[float]:
        """`zorro/self_check`: 1.0 every check passed, 0.0 one failed (the actor fell back), None none ran."""
        if self.failed is not None:
            return 0.0
        return 1.0 if self.verdicts else None

    def register(self, actor: _Actor) -> None:
        """At the first call of a deduplicating actor whose verdicts are exchanged, under torch.distributed:
        this rank's setting (`enabled`) written to the process group's store, keyed by the order of such
        actors in this process (ranks build theirs alike). A write, not a collective: an actor one rank
        uses alone (e.g. rank 0's evaluation) waits for nobody. A rank that checks reads the others'
        settings before its first verdict exchange (`_check_setting`)."""
        if self.registered or not self.exchange or not actor.dedup:
            return
        self.registered = True
        store = _store()
        if store is not None:
            self.slot = f"zorro/self_check/{next(_SLOTS)}"
            store.set(f"{self.slot}/{dist.get_rank()}", "on" if self.enabled else "off")

    def _check_setting(self) -> None:
        """Before this rank's first verdict exchange: every rank's setting (`register`), waited for as
        long as the exchange would wait; a rank with the check off would never come to the exchange,
        so that is refused here, naming the setting and the ranks."""
        if self.setting_refused:
            raise ValueError(self.setting_refused)  # every later call too: the exchange would still wait
        store = _store()
        if self.slot is None or self.setting_checked or store is None:
            return
        self.setting_checked = True
        keys = [f"{self.slot}/{r}" for r in range(dist.get_world_size())]
        store.wait(keys)
        off = [r for r, k in enumerate(keys) if store.get(k) == b"off"]
        if off:
            on = [r for r in range(len(keys)) if r not in off]
            self.setting_refused = (
                f"zorro: the self-check (ActorConfig.self_check) is on on rank(s) {on} and off on rank(s) {off}: "
                "every rank must take the same setting (its default, None, is on for CUDA and off for CPU), or the "
                "ranks that check wait in the verdict exchange for ranks that never come. (The ranks' actors are "
                "matched in the order of their first calls: an actor that only some ranks call, as rank 0's "
                "evaluation, needs `actor.self_check.exchange = False`.)"
            )
            raise ValueError(self.setting_refused)

    def settle(self, verdict: SelfCheckVerdict, device: torch.device) -> Optional[SelfCheckVerdict]:
        """This rank's `verdict`, agreed over the ranks (when exchanged): the verdict to record, or None
        when nothing was judged (warned; or this rank's own model error raised to the caller). When
        another rank failed while this one met its model's own error, the failure is recorded like on
        that rank and the error waits in `pending` (`raise_pending`, once the call's checks are made)."""
        if self.exchange:
            self._check_setting()
        agreed = agree(verdict, device) if self.exchange else verdict
        if not agreed.judged:
            if verdict.raised is not None:
                raise verdict.raised
            warnings.warn(
                f"zorro: the self-check {agreed.describe()}. The call runs on zorro's path unchecked; the next "
                "call checks again.",
                SelfCheckWarning,
                stacklevel=5,
            )
            return None
        if verdict.raised is not None:
            self.pending = self.pending or verdict.raised
        return agreed

    def raise_pending(self) -> None:
        """Raise this rank's model error kept by `settle`, if any."""
        error, self.pending = self.pending, None
        if error is not None:
            raise error

    def route(
        self, actor: _Actor, batch: RolloutBatch, spec: RouteSpec, dedup: bool, temperature: float
    ) -> tuple[RouteSpec, bool]:
        """The (spec, dedup) the actor runs this call with: its own once checked right, else the fallback."""
        self.register(actor)
        chosen = self._route(actor, batch, spec, dedup, temperature)
        self.raise_pending()
        return chosen

    def _route(
        self, actor: _Actor, batch: RolloutBatch, spec: RouteSpec, dedup: bool, temperature: float
    ) -> tuple[RouteSpec, bool]:
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
                settled = self.settle(check(actor, batch, spec, dedup, temperature, key), actor.device)
                if settled is None:
                    return spec, dedup  # nothing judged: this call unchecked, the next one checks again
                verdict = self.verdicts[key] = settled
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


_SLOTS = itertools.count()
"""The order of this process's registered self-checks (`SelfCheck.register`): their keys in the store."""


def _store() -> Optional["dist.Store"]:
    """The default process group's store, under torch.distributed with more than one rank (None otherwise,
    or where this torch does not expose it: the settings are then not compared)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


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


def _float64_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The gated delta rule computed in float64 (zorro_core.models.exact_delta_rule), with the
    calls of transformers' PyTorch kernel and of fla's (`cu_seqlens`: each segment on its own): the
    reference of a check on a model with gated DeltaNet layers (module doc)."""

    def run(a: int, b: int, init: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        q, k, v, gg, bb = (x[:, a:b].to(torch.float64) for x in (query, key, value, g, beta))
        return chunk_gated_delta_rule_exact(
            q,
            k,
            v,
            gg,
            bb,
            chunk_size=chunk_size,
            initial_state=None if init is None else init.to(torch.float64),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )

    if cu_seqlens is None:
        out, state = run(0, query.shape[1], initial_state)
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        parts = [
            run(a, b, None if initial_state is None else initial_state[i : i + 1])
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        out = torch.cat([o for o, _ in parts], 1)
        state = torch.cat([st for _, st in parts if st is not None]) if output_final_state else None
    return out.to(query.dtype), state


def _finite(lp: torch.Tensor, mask: torch.Tensor, grads: list[torch.Tensor]) -> bool:
    return bool(lp[mask].isfinite().all()) and all(bool(g.isfinite().all()) for g in grads)


def _note(error: BaseException, note: str) -> BaseException:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(note)
    return error


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
    prompt-once schedule's, zorro_core.actor.schedule): the same projection, loss and comparison.
    The model's own errors give an unjudged verdict (`SelfCheckVerdict.unjudged`, its exception in
    `raised`) instead of raising here, so that the ranks still meet in `agree`."""
    start = time.perf_counter()
    dtype = compute_dtype(actor)
    reference = RouteSpec("split", "reference", spec.attention)

    def verdict(**kw) -> SelfCheckVerdict:
        kw.setdefault("passed", False)
        kw = {"logprob_error": math.inf, "logprob_allowed": 0.0, "grad_error": math.inf, "grad_allowed": 0.0, **kw}
        return SelfCheckVerdict(key, parameter=kw.pop("parameter", ""), seconds=time.perf_counter() - start, **kw)

    with torch.inference_mode(False), torch.enable_grad(), _eval_mode(actor.model):
        part = slice_of(batch)
        params = _vectors(actor.model)
        mask = part.response_mask.bool()
        linear = bool(linear_layers(actor.model))

        def checked():
            if under_test is not None:
                return under_test(part, params)
            return _run(actor, part, spec, dedup, temperature, params)

        def plain(on: RouteSpec, delta_rule: Optional[Callable] = None):
            if delta_rule is None:
                return _run(actor, part, on, False, temperature, params)
            with delta_rule_of(actor.model, delta_rule):
                return _run(actor, part, on, False, temperature, params)

        try:
            lp, grads = checked()
        except torch.OutOfMemoryError:
            raise  # the device's memory, not the path: the fallback would meet it too
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here (its signature, this GPU) fails the check
            if under_test is None and fallback_of(spec, dedup) is None:
                raise  # the plain computation itself: nothing to fall back to, the trainer sees its error
            why = f"{type(e).__name__}: {e}"
            try:
                plain(reference)
            except torch.OutOfMemoryError:
                raise
            except Exception as plain_error:  # noqa: BLE001 - the model's own error: the caller's
                note = (
                    f"zorro's self-check: the plain computation raises it too ({type(plain_error).__name__}), "
                    "so it is the model's own error, not a fault of zorro's path; no verdict was recorded and the "
                    "next call checks again"
                )
                return verdict(unjudged=f"the model's own error: {why}", raised=_note(e, note))
            try:
                checked()
            except torch.OutOfMemoryError:
                raise
            except Exception as again:  # noqa: BLE001 - zorro's path raises where the plain one does not
                return verdict(error=f"{type(again).__name__}: {again}")
            note = (
                "zorro's self-check: neither the plain computation nor a second try of zorro's path raised it "
                "(a transient error of the model's own code), so it is not a fault of zorro's path; no verdict "
                "was recorded and the next call checks again"
            )
            return verdict(unjudged=f"a transient error: {why}", raised=_note(e, note))

        def exact_rule(module_kernel: Callable, query: torch.Tensor) -> Callable:
            return _float64_delta_rule

        exact = exact_rule if linear else None
        if linear:  # zorro's path again, its delta rule in float64 like the reference's (module doc)
            try:
                with delta_rule_of(actor.model, exact_rule):
                    lp_exact, grads_exact = checked()
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - zorro's path (or the check's delta rule) cannot serve it
                return verdict(error=f"{type(e).__name__} with the delta rule in float64: {e}")
        try:
            # The reference: the plain computation on the oracle backend (with the delta rule in float64
            # where gated DeltaNet layers compute theirs in float32); the second right computations.
            lp_ref, grads_ref = plain(reference, exact)
            sdpa = RouteSpec("split", "sdpa", spec.attention)
            spread = [plain(sdpa, exact)] if dtype != torch.float64 else []
            kernel = [plain(reference)] + ([plain(sdpa)] if dtype != torch.float64 else []) if linear else []
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - the plain computation raises where zorro's path did not
            note = (
                "zorro's self-check: the plain computation raised it (zorro's path did not): the model's own "
                "error, not a fault of zorro's path; no verdict was recorded and the next call checks again"
            )
            return verdict(unjudged=f"the plain computation raised {type(e).__name__}: {e}", raised=_note(e, note))
        if not _finite(lp_ref, mask, grads_ref):
            return verdict(
                unjudged="the plain computation itself gives non-finite log-probs or gradients on the checked rows "
                "(NaN or inf from the model's own weights or code), so there is nothing to compare against: not a "
                "fault of zorro's path"
            )
    names = [n for n, _ in params]
    ref = (lp_ref, grads_ref)
    if not linear:
        figures = _compare((lp, grads), ref, spread, mask, dtype, names)
    else:
        # zorro's own computation at the dtype's rule, per parameter, the delta rule exact on both sides;
        # and the model's kernel under zorro's calls against its noise under the plain calls, over all the
        # checked parameters at once (a parameter whose gradient nearly cancels, as A_log's or dt_bias's,
        # takes that kernel's float32 rounding at O(1) relative, so it is judged in the first comparison).
        own = _compare((lp_exact, grads_exact), ref, spread, mask, dtype, names)
        whole = _compare(
            (lp, _joined(grads)),
            (lp_ref, _joined(grads_ref)),
            [(x, _joined(g)) for x, g in kernel],
            mask,
            dtype,
            ["every checked parameter, with the model's delta rule"],
        )
        figures = max(own, whole, key=lambda f: max(f[0] / f[1], f[2] / f[3]))
    lp_err, lp_allowed, grad_err, grad_allowed, name = figures
    passed = math.isfinite(lp_err) and math.isfinite(grad_err) and lp_err <= lp_allowed and grad_err <= grad_allowed
    if linear:
        passed = passed and all(f[0] <= f[1] and f[2] <= f[3] and math.isfinite(f[0] + f[2]) for f in (own, whole))
    return verdict(
        passed=passed,
        logprob_error=lp_err,
        logprob_allowed=lp_allowed,
        grad_error=grad_err,
        grad_allowed=grad_allowed,
        parameter=name,
    )


def _joined(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every parameter's gradient as one vector (one relative error over them all)."""
    return [torch.cat([g.detach().double().flatten() for g in grads])] if grads else []


def _compare(
    path: tuple[torch.Tensor, list[torch.Tensor]],
    ref: tuple[torch.Tensor, list[torch.Tensor]],
    seconds: list[tuple[torch.Tensor, list[torch.Tensor]]],
    mask: torch.Tensor,
    dtype: torch.dtype,
    names: list[str],
) -> tuple[float, float, float, float, str]:
    """(log-prob error, allowed, worst gradient error, its allowance, its name) of `path` against `ref`
    by the rule (module doc): float64 with no second computation, the floors; else FACTOR x the
    second right computations' largest distance to `ref` (at least EPS_UNITS epsilons) plus the floors."""
    (lp, grads), (lp_ref, grads_ref) = path, ref
    lp_err = float((lp - lp_ref).double().abs()[mask].max())
    errs = [_rel(a, b) for a, b in zip(grads, grads_ref)]
    eps = 0.0 if dtype == torch.float64 else torch.finfo(dtype).eps * EPS_UNITS
    noise_lp = max([float((x - lp_ref).double().abs()[mask].max()) for x, _ in seconds] + [eps])
    lp_allowed = FACTOR * noise_lp + LOGPROB_FLOOR
    noise = [max([_rel(g2[i], b) for _, g2 in seconds] + [eps]) for i, b in enumerate(grads_ref)]
    allowed = [FACTOR * n + GRAD_FLOOR for n in noise]
    if any(not math.isfinite(e) for e in errs):
        worst: Optional[int] = next(i for i, e in enumerate(errs) if not math.isfinite(e))
    else:
        worst = max(range(len(errs)), key=lambda i: errs[i] / allowed[i], default=None)
    if worst is None:
        return lp_err, lp_allowed, 0.0, GRAD_FLOOR, ""
    return lp_err, lp_allowed, errs[worst], allowed[worst], names[worst]


_FIGURES = 5
"""(status, log-prob error, allowed, gradient error, allowed) of each rank's verdict in `agree`."""
_TEXT_BYTES = 512
"""UTF-8 bytes of each of a rank's texts in `agree` (what its path raised, why it judged nothing, its
worst parameter; longer ones are cut)."""
_PASSED, _UNJUDGED, _FAILED = 0.0, 1.0, 2.0


def _pack(verdict: SelfCheckVerdict, device: torch.device) -> torch.Tensor:
    status = _PASSED if verdict.passed else _UNJUDGED if verdict.unjudged else _FAILED
    figures = [status, verdict.logprob_error, verdict.logprob_allowed, verdict.grad_error, verdict.grad_allowed]
    numbers = torch.tensor(figures, dtype=torch.float64).view(torch.uint8)
    texts = (verdict.error, verdict.unjudged, verdict.parameter)
    text = b"".join(t.encode()[:_TEXT_BYTES].ljust(_TEXT_BYTES, b"\x00") for t in texts)
    return torch.cat([numbers, torch.frombuffer(bytearray(text), dtype=torch.uint8)]).to(device)


def _unpack(data: torch.Tensor, verdict: SelfCheckVerdict, rank: int) -> SelfCheckVerdict:
    data = data.cpu()
    status, lp_err, lp_allowed, grad_err, grad_allowed = data[: _FIGURES * 8].clone().view(torch.float64).tolist()
    raw = bytes(data[_FIGURES * 8 :].tolist())
    error, unjudged, parameter = (
        raw[i * _TEXT_BYTES : (i + 1) * _TEXT_BYTES].rstrip(b"\x00").decode(errors="ignore") for i in range(3)
    )
    return replace(
        verdict,
        passed=status == _PASSED,
        logprob_error=lp_err,
        logprob_allowed=lp_allowed,
        grad_error=grad_err,
        grad_allowed=grad_allowed,
        parameter=parameter,
        error=error,
        unjudged=unjudged,
        rank=rank,
        raised=None,
    )


def agree(verdict: SelfCheckVerdict, device: torch.device) -> SelfCheckVerdict:
    """The worst verdict over the data-parallel ranks (all-gathered when torch.distributed is
    initialised; every rank makes the same first calls, so every rank gathers here): a failure,
    else a rank that judged nothing, else the pass. Another rank's comes with its figures and its
    reason (what its path raised, why it judged nothing) and names that rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return verdict
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = _pack(verdict, on)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    status = [float(t[: _FIGURES * 8].cpu().clone().view(torch.float64)[0]) for t in every]
    for worst in (_FAILED, _UNJUDGED):
        ranks = [i for i, s in enumerate(status) if s == worst]
        if ranks:
            if dist.get_rank() in ranks:
                return verdict
            return _unpack(every[ranks[0]], verdict, ranks[0])
    return verdict


def verdict_of(actor: _Actor, batch: RolloutBatch, temperature: float = 1.0) -> SelfCheckVerdict:
    """The self-check of `actor`'s own path on `batch`, agreed over the ranks, without switching the
    actor (what `zorro verify gradients` reports beside its proof). The model's own error is raised."""
    spec, dedup = actor.route_spec, actor.dedup
    return raise_own(check(actor, batch, spec, dedup, temperature, key_of(actor, spec, dedup)), actor.device)


def raise_own(verdict: SelfCheckVerdict, device: torch.device) -> SelfCheckVerdict:
    """`verdict` agreed over the ranks; this rank's own model error (`raised`) raised after the exchange."""
    agreed = agree(verdict, device)
    if verdict.raised is not None:
        raise verdict.raised
    return agreed
