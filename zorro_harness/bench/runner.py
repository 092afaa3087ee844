"""Run one benchmark case in fresh processes and turn it into result rows (one per phase).

- Before anything is allocated, the case's memory is estimated from its shapes
  (footprint.py): an arm that cannot fit is refused with the figure (status=oom), the other
  still runs. Nothing of the case is built in the sweep's process: the workload (batch and
  plans, for the ideal speedup) is computed in a case process too (isolation.py: timeout,
  memory watchdog, no orphans).
- The timing process builds the model, the batch and both actors, then times baseline and
  dedup interleaved for each phase (a speedup is a ratio from one run). On CUDA it also
  reads max_memory_allocated for each arm.
- On CPU, peak memory is measured in a fresh process per arm and phase (see measure.py).
- A raise, an out-of-memory, a crash or a timeout becomes the case's status; the caller goes on.
- A case that cannot run here (CUDA absent; Liger where liger_unavailable says why) is a
  status=skipped row with the reason, not an error.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from zorro_core.actor.actor import BaselineActor, DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.attention.backends import backend_unavailable
from zorro_core.models.presets import load_model
from zorro_core.models.registry import model_shape
from zorro_core.plan.build import build_dedup_plan, build_plain_plan
from zorro_core.plan.cost import compare_plans
from zorro_core.plan.dtypes import DTYPES
from zorro_core.stack.auto import choose_attention
from zorro_core.stack.checkpointing import enable_checkpointing
from zorro_core.stack.liger import apply_liger, liger_unavailable
from zorro_harness.bench.distributed import distributed_case_rows
from zorro_harness.bench.footprint import case_footprint, too_large
from zorro_harness.bench.inputs import make_batch, model_config
from zorro_harness.bench.isolation import ChildResult, run_isolated
from zorro_harness.bench.measure import (
    CPU_PEAK_KIND,
    Stats,
    peak_memory_mib,
    speedup_columns,
    summarize,
    time_columns,
    time_interleaved,
)
from zorro_harness.bench.suite import PHASES, Case, Measure

ARMS = ("baseline", "dedup")


@dataclass
class Workload:
    """What the case computes, known before anything runs."""

    logical_tokens: int
    """Real tokens before dedup (what both arms' tokens/s count)."""
    unique_tokens: int
    """Tokens in the packed row after dedup."""
    prompt_dedup_ratio: float
    token_redundancy: float
    ideal_speedup: dict[str, float]
    """Per phase: baseline FLOPs / dedup FLOPs."""
    baseline_gflops: dict[str, float]
    dedup_gflops: dict[str, float]


def case_workload(case: Case) -> Workload:
    """Tokens, redundancy and ideal speedup of a case, from its config and batch (no weights)."""
    config = model_config(case.model)
    batch = make_batch(case, config.vocab_size)
    prompt_plan = build_dedup_plan(batch, dedup=True)
    base = prompt_plan if case.baseline == "prompt" else build_plain_plan(batch)
    dedup = build_dedup_plan(
        batch, dedup=True, sharing=case.actor.sharing, min_shared_tokens=case.actor.min_shared_tokens
    )
    cmp = compare_plans(model_shape(config), base, dedup, case.actor.logits_mode)
    return Workload(
        logical_tokens=dedup.logical_tokens,
        unique_tokens=dedup.num_tokens,
        prompt_dedup_ratio=prompt_plan.prompt_dedup_ratio,
        token_redundancy=dedup.token_redundancy,
        ideal_speedup={p: cmp.ideal_speedup(p) for p in PHASES},
        baseline_gflops={p: cmp.baseline.phase(p) / 1e9 for p in PHASES},
        dedup_gflops={p: cmp.dedup.phase(p) / 1e9 for p in PHASES},
    )


class CaseSkipped(Exception):
    """The case cannot run on this machine (the message says why): a status=skipped row."""


# ---------------------------------------------------------------- inside the case process


class _Bench:
    """Model, batch and the two actors of a case, built inside the case process."""

    def __init__(self, case: Case, threads: int, arms: tuple[str, ...] = ARMS) -> None:
        if threads:
            torch.set_num_threads(threads)
        if case.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"device {case.device} requested but CUDA is not available here")
        self.device = torch.device(case.device)
        attn = str(case.actor.attn_implementation)
        if attn == "auto":  # resolved once, the same for both arms (zorro_core.stack.auto's rule)
            attn = choose_attention(
                self.device, DTYPES[case.dtype], case.prompt_len + case.response_len, case.actor.use_split_attention
            ).implementation
        self.model = load_model(
            case.model, device=self.device, dtype=DTYPES[case.dtype], attn_implementation=attn, seed=case.seed
        )
        self.model.eval()  # no dropout; gradients still flow
        if case.checkpointing:  # what a trainer runs: every decoder layer recomputed in backward (training mode)
            enable_checkpointing(self.model, "non-reentrant")
            self.model.train()
        self.liger_kernels = ""
        if case.liger:  # before the actors: liger swaps the instance's modules (and RoPE module-wide)
            why = liger_unavailable(self.model)
            if why:
                raise CaseSkipped(why)
            self.liger_kernels = ",".join(apply_liger(self.model).applied)
        self.batch = make_batch(case, self.model.config.vocab_size, device=str(self.device))
        self.n_response = int(self.batch.response_mask.sum())
        config = case.actor_config(attn)
        plain = ActorConfig(
            attn_implementation=attn,
            logits_mode=case.actor.logits_mode,
            logits_memory_budget_mib=case.actor.logits_memory_budget_mib,
        )
        self.actors: dict[str, Any] = {}
        if "baseline" in arms:
            if case.baseline == "padded":
                self.actors["baseline"] = BaselineActor(model=self.model, config=plain, padded=True)
            elif case.baseline == "prompt":  # the prompt-sharing dedup arm, to measure what prefix sharing adds
                self.actors["baseline"] = DeduplicatedActor(model=self.model, config=config.replace(sharing="prompt"))
            else:  # packed, split attention through the same backend as the dedup arm
                packed = plain.replace(varlen_backend=case.actor.varlen_backend)
                self.actors["baseline"] = BaselineActor(model=self.model, config=packed)
        if "dedup" in arms:
            self.actors["dedup"] = DeduplicatedActor(model=self.model, config=config)

    def baseline_kind(self) -> str:
        a = self.actors.get("baseline")
        if a is None:
            return ""
        if a.dedup:
            return (
                f"dedup_prompt_split_{a.varlen_backend}"
                if a.config.use_split_attention
                else f"dedup_prompt_mask_{a.attn_implementation}"
            )
        if getattr(a, "padded", False):
            return f"padded_hf_{a.attn_implementation}"
        return f"packed_varlen_{a.varlen_backend}"

    def dedup_kind(self) -> str:
        a = self.actors.get("dedup")
        if a is None:
            return ""
        kind = f"split_{a.varlen_backend}" if a.config.use_split_attention else f"mask_{a.attn_implementation}"
        return kind if a.config.sharing == "prompt" else f"{a.config.sharing}_{kind}"

    def step(self, arm: str, phase: str) -> Callable[[], None]:
        actor, batch, n = self.actors[arm], self.batch, self.n_response

        def forward() -> None:
            with torch.no_grad():
                actor.forward(batch)

        def forward_backward() -> None:
            out = actor.forward(batch)
            (out.log_probs.sum() / n).backward()

        return forward if phase == "forward" else forward_backward

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _error_text(e: BaseException) -> str:
    if isinstance(e, CaseSkipped):
        return str(e)[:500]
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]


def _status_of(e: BaseException) -> str:
    return "skipped" if isinstance(e, CaseSkipped) else "oom" if _is_oom(e) else "error"


def _apply_fault(fault: Optional[str]) -> None:
    """Test hook: make the case process fail on purpose ("raise", "exit", "sleep", "grow": take
    memory 64 MiB at a time, up to 4 GiB, as a blow-up the estimate did not foresee)."""
    if fault == "raise":
        raise RuntimeError("injected fault")
    if fault == "exit":
        os._exit(3)
    if fault == "sleep":
        time.sleep(3600)
    if fault == "grow":
        held = []
        for _ in range(64):
            held.append(bytearray(64 * 2**20))  # zero-filled: the pages are touched, resident
            time.sleep(0.05)


def _time_phase(bench: _Bench, phase: str, measure: Measure) -> dict[str, Any]:
    """Warm up each arm (dropping an arm that runs out of memory), then time them interleaved."""
    res: dict[str, Any] = {"status": "ok", "error": ""}
    arms = {}
    for arm in bench.actors:
        fn = bench.step(arm, phase)
        oom = False
        try:
            for _ in range(max(1, measure.warmup)):
                bench.zero_grad()
                fn()
            arms[arm] = fn
        except Exception as e:
            if not _is_oom(e):
                raise
            res.update(status="oom", error=f"{arm}: {_error_text(e)}")
            oom = True
        if oom:  # outside the except block, where the traceback no longer pins the arm's tensors
            bench.zero_grad()
            _free(bench.device)
    if arms:
        times = time_interleaved(arms, bench.device, warmup=0, repeats=measure.repeats, between=bench.zero_grad)
        res["times"] = times
    if bench.device.type == "cuda" and measure.memory:
        for arm, fn in arms.items():
            bench.zero_grad()
            _free(bench.device)
            res[f"{arm}_peak_mib"], res["peak_mem_kind"] = peak_memory_mib(fn, bench.device)
    bench.zero_grad()
    return res


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def workload_process(case: Case, conn) -> None:
    """Entry point of the workload process: sends the case's Workload as a dict, or {"error": text}."""
    try:
        conn.send({"workload": asdict(case_workload(case))})
    except BaseException as e:
        conn.send({"error": _error_text(e), "status": _status_of(e)})
    finally:
        conn.close()


def timing_process(case: Case, measure: Measure, fault: Optional[str], arms: tuple[str, ...], conn) -> None:
    """Entry point of the timing process: sends {phase: result} or {"error": text}."""
    try:
        _apply_fault(fault)
        bench = _Bench(case, measure.threads, arms=arms)
        out: dict[str, Any] = {
            "baseline_kind": bench.baseline_kind(),
            "dedup_kind": bench.dedup_kind(),
            "liger_kernels": bench.liger_kernels,
            "threads": torch.get_num_threads(),
            "phases": {},
        }
        for phase in measure.phases:
            try:
                out["phases"][phase] = _time_phase(bench, phase, measure)
            except Exception as e:
                status = "oom" if _is_oom(e) else "error"
                out["phases"][phase] = {"status": status, "error": _error_text(e), "traceback": traceback.format_exc()}
            bench.zero_grad()
            _free(bench.device)
        conn.send(out)
    except BaseException as e:  # the parent must always hear why
        conn.send({"error": _error_text(e), "status": _status_of(e), "traceback": traceback.format_exc()})
    finally:
        conn.close()


def memory_process(case: Case, measure: Measure, arm: str, phase: str, conn) -> None:
    """Entry point of a CPU memory process: one cold run of one arm and phase."""
    try:
        bench = _Bench(case, measure.threads, arms=(arm,))
        fn = bench.step(arm, phase)
        fn()  # untimed first run: see measure.py on why the figure is of a second run
        bench.zero_grad()
        mib, kind = peak_memory_mib(fn, bench.device)
        conn.send({"peak_mib": mib, "kind": kind})
    except BaseException as e:
        conn.send({"error": _error_text(e), "status": _status_of(e)})
    finally:
        conn.close()


# ---------------------------------------------------------------- in the parent


def refused_arms(case: Case, config, phases: tuple[str, ...], max_memory: Optional[int]) -> dict[str, str]:
    """{arm: why} for each arm whose memory estimate (footprint.py) cannot fit."""
    out = {}
    for arm in ARMS:
        why = too_large(case_footprint(case, config, phases, arm), max_memory, case.device)
        if why:
            out[arm] = f"refused before running: {why}"
    return out


def _workload(case: Case, measure: Measure, max_memory: Optional[int]) -> tuple[Optional[Workload], ChildResult]:
    res = run_isolated(workload_process, (case,), measure.timeout_s, max_memory)
    return (Workload(**res.payload["workload"]) if res.status == "ok" else None), res


def case_rows(
    case: Case,
    measure: Measure,
    fault: Optional[str] = None,
    on_phase: Optional[Callable[[dict], None]] = None,
    max_memory: Optional[int] = None,
) -> list[dict[str, Any]]:
    """The result rows of a case, one per phase; failures become rows with their status.
    max_memory: bytes a case may take (None: what the machine has available)."""
    base = case_base_row(case, measure)
    if case.nproc > 1:  # data-parallel ranks, no-regroup vs regroup: a process tree of its own
        return distributed_case_rows(case, measure, base, on_phase)

    def failed(status: str, error: str) -> list[dict[str, Any]]:
        rows = [dict(base, phase=p, status=status, error=error) for p in measure.phases]
        for r in rows:
            _emit(r, on_phase)
        return rows

    try:
        refused = refused_arms(case, model_config(case.model), measure.phases, max_memory)
    except Exception as e:
        return failed("error", _error_text(e))
    if len(refused) == len(ARMS):
        return failed("oom", refused["dedup"])
    work, res = _workload(case, measure, max_memory)
    if work is None:
        return failed(res.status, res.error)
    _fill_workload(base, work)
    why = skip_reason(case)
    if why:
        rows = []
        for p in measure.phases:
            rows.append(_phase_row(base, work, p, status="skipped", error=why))
            _emit(rows[-1], on_phase)
        return rows
    arms = tuple(a for a in ARMS if a not in refused)
    timing = run_isolated(timing_process, (case, measure, fault, arms), measure.timeout_s, max_memory)
    base["liger_kernels"] = timing.payload.get("liger_kernels", "")
    base["baseline_kind"] = timing.payload.get("baseline_kind", "")
    base["dedup_kind"] = timing.payload.get("dedup_kind", "")
    base["threads"] = timing.payload.get("threads", measure.threads or "")
    rows = []
    for phase in measure.phases:
        if timing.status != "ok":
            row = _phase_row(base, work, phase, status=timing.status, error=timing.error)
        else:
            res = timing.payload["phases"][phase]
            status, errors = res["status"], [res.get("error", "")]
            for arm, why in refused.items():
                status = "oom" if status == "ok" else status
                errors.append(f"{arm}: {why}")
            row = _phase_row(base, work, phase, status=status, error="; ".join(e for e in errors if e))
            _fill_timing(row, res, work, phase)
            if measure.memory and not case.device.startswith("cuda"):
                _fill_cpu_memory(row, case, measure, phase, res, max_memory)
        rows.append(row)
        _emit(row, on_phase)
    return rows


def skip_reason(case: Case) -> Optional[str]:
    """Why the case cannot run on this machine, known without starting it (None: try it).
    Liger on a CUDA device is checked in the case process, which has the model on the GPU."""
    if case.device.startswith("cuda") and not torch.cuda.is_available():
        return f"device {case.device} is not available on this machine (no CUDA)"
    if case.liger and not case.device.startswith("cuda"):
        return liger_unavailable(model_config(case.model).model_type, case.device)
    a = case.actor
    if a.use_split_attention and str(a.attn_implementation).startswith("flash_attention") and not a.varlen_backend:
        # flash-attn needs CUDA and its package: a GPU suite run with --device cpu skips these rows.
        return backend_unavailable("flash_attn", case.device)
    return None


def _emit(row: dict, on_phase: Optional[Callable[[dict], None]]) -> None:
    if on_phase is not None:
        on_phase(row)


def case_base_row(case: Case, measure: Measure) -> dict[str, Any]:
    """The case's columns of its rows. The column names are the results file's format (read by
    `zorro report` and by --resume of files written before), not the config's spelling: the
    actor's `use_split_attention` stays the `split_attention` column."""
    a = case.actor
    return {
        "case_id": case.case_id,
        "model": case.model,
        "attn_implementation": a.attn_implementation,
        "split_attention": a.use_split_attention,
        "logits_mode": a.logits_mode,
        "logits_memory_budget_mib": a.logits_memory_budget_mib if a.logits_memory_budget_mib is not None else "",
        "dtype": case.dtype,
        "device": case.device,
        "batch_size": case.batch_size,
        "num_unique_prompts": case.num_unique_prompts,
        "prompt_len": case.prompt_len,
        "response_len": case.response_len,
        "padding": case.padding,
        "baseline_kind": "",
        "dedup_kind": "",
        "warmup": measure.warmup,
        "repeats": measure.repeats,
        "threads": measure.threads or "",
        "seed": case.seed,
        "liger": case.liger,
        "liger_kernels": "",
        "checkpointing": case.checkpointing,
        "peak_mem_kind": "not_measured",
        "sharing": a.sharing,
        "shared_prefix_len": case.shared_prefix_len,
        "min_shared_tokens": a.min_shared_tokens if a.sharing != "prompt" else "",
    }


def _fill_workload(row: dict, work: Workload) -> None:
    row.update(
        prompt_dedup_ratio=round(work.prompt_dedup_ratio, 6),
        token_redundancy=round(work.token_redundancy, 6),
        logical_tokens=work.logical_tokens,
        unique_tokens=work.unique_tokens,
    )


def _phase_row(base: dict, work: Workload, phase: str, status: str, error: str = "") -> dict[str, Any]:
    return dict(
        base,
        phase=phase,
        status=status,
        error=error,
        ideal_speedup=round(work.ideal_speedup[phase], 4),
        baseline_gflops=round(work.baseline_gflops[phase], 3),
        dedup_gflops=round(work.dedup_gflops[phase], 3),
    )


def _fill_timing(row: dict, res: dict, work: Workload, phase: str) -> None:
    times = res.get("times", {})
    stats: dict[str, Stats] = {arm: summarize(t) for arm, t in times.items()}
    for arm, s in stats.items():
        row.update(time_columns(arm, s))
        row[f"{arm}_tokens_per_s"] = round(work.logical_tokens / (s.p50 / 1e3), 1)
        row["n"] = s.n
    if len(stats) == 2:
        row.update(speedup_columns(times["baseline"], times["dedup"], work.ideal_speedup[phase]))
    for arm in ("baseline", "dedup"):
        if f"{arm}_peak_mib" in res:
            row[f"{arm}_peak_mem_mib"] = round(res[f"{arm}_peak_mib"], 1)
            row["peak_mem_kind"] = res["peak_mem_kind"]


def _fill_cpu_memory(row: dict, case: Case, measure: Measure, phase: str, res: dict, max_memory: Optional[int]) -> None:
    """One fresh process per arm for this phase (only arms that ran), the two side by side:
    a peak RSS is per process, so they do not disturb each other's figure (timing is done)."""
    notes = []
    arms = [a for a in ("baseline", "dedup") if a in res.get("times", {})]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(
            pool.map(
                lambda a: run_isolated(memory_process, (case, measure, a, phase), measure.timeout_s, max_memory), arms
            )
        )
    for arm, mem in zip(arms, results):
        if mem.status == "ok" and "peak_mib" in mem.payload:
            row[f"{arm}_peak_mem_mib"] = round(mem.payload["peak_mib"], 1)
            row["peak_mem_kind"] = mem.payload["kind"]
        else:
            notes.append(f"{arm} memory: {mem.status} {mem.error}".strip())
    if notes:
        row["error"] = "; ".join(x for x in [row.get("error", "")] + notes if x)
    elif row["peak_mem_kind"] == "not_measured":
        row["peak_mem_kind"] = CPU_PEAK_KIND
