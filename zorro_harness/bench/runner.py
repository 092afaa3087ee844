"""Run one benchmark case in fresh processes and turn it into result rows (one per phase).

- Before anything is allocated, the case's memory is estimated from its shapes
  (footprint.py): an arm that cannot fit is refused with the figure (status=oom), the other
  still runs. Nothing of the case is built in the sweep's process: the workload (batch and
  plans, for the ideal speedup) is computed in a case process too (isolation.py: timeout,
  memory watchdog, no orphans).
- The timing process (case_process.py) builds the model, the batch and both actors, then times
  baseline and dedup interleaved for each phase (a speedup is a ratio from one run). On CUDA it
  also reads max_memory_allocated for each arm.
- On CPU, peak memory is measured in a fresh process per arm and phase (see measure.py).
- A raise, an out-of-memory, a crash or a timeout becomes the case's status; the caller goes on.
- A case that cannot run here (CUDA absent; Liger where liger_unavailable says why) is a
  status=skipped row with the reason, not an error.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

from zorro_core.attention.backends import backend_unavailable
from zorro_core.models.presets import weights_source
from zorro_core.stack.liger import liger_unavailable
from zorro_harness.bench.case_process import (
    ARMS,
    Workload,
    _error_text,
    memory_process,
    timing_process,
    workload_process,
)
from zorro_harness.bench.distributed import distributed_case_rows
from zorro_harness.bench.footprint import case_footprint, too_large
from zorro_harness.bench.inputs import model_config
from zorro_harness.bench.isolation import ChildResult, run_isolated
from zorro_harness.bench.measure import (
    CPU_PEAK_KIND,
    Stats,
    speedup_columns,
    summarize,
    time_columns,
)
from zorro_harness.bench.suite import Case, Measure


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
        "weights": _weights(case.model),
    }


def _weights(model: str) -> str:
    """ "checkpoint" or "random" (a preset: a hub name not in the cache is one); "" for a name that does not
    resolve, whose case fails with load_model's own message."""
    try:
        return weights_source(model)
    except ValueError:
        return ""


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


_MOVED = ("case_workload", "CaseSkipped", "_Bench")


def __getattr__(name: str) -> Any:
    """What runs inside the case processes moved to zorro_harness.bench.case_process; the old path warns."""
    if name in _MOVED:
        import warnings

        from zorro_harness.bench import case_process

        warnings.warn(
            f"zorro_harness.bench.runner.{name} moved to zorro_harness.bench.case_process.{name} "
            "(removed after 2027-06-01)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(case_process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
