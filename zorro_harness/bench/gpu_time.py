"""`zorro bench gpu-time`: the seed's headline table from one process, its first row in the first minute.

A GPU is lent now and then, for minutes; a sweep that builds the model on the CPU and forks a
process per case (zorro_harness.bench.runner) spent a lease's whole first minute before its
first timing. This harness runs every case in ONE process:
- the model is built once, on the device, in the case's dtype, from its config (a preset's published
  shape, random weights): created under `torch.device(device)`, so no weight is initialised on the CPU
  and copied over (`build_on_device` checks that every tensor landed there);
- per case, the batch is built on the device and both arms (the packed baseline through the same
  varlen backend: torch's flash kernel pair on CUDA, flash-attn's where installed, `flash_cpu` on the
  CPU as its stand-in; and zorro) are warmed up, then timed interleaved (measure.time_interleaved: the
  order reversed every round, a speedup is the median of the paired ratios) with CUDA events on a GPU
  and perf_counter on the CPU;
- peak memory per arm is torch.cuda.max_memory_allocated over its first warm-up call (weights
  included); on the CPU it is not measured here ("n/a": `zorro bench sweep` measures a fresh process
  per arm);
- the cost model's ideal speedup (zorro_core.plan.cost) is beside every row;
- each row is printed and appended whole to the CSV (results.ResultWriter: one write, fsync) when its
  case ends, so a run killed at any moment keeps every finished case; `resume` skips the cases whose
  last row is ok (or oom);
- `budget_s` (counted from the harness's start) stops between cases: a case starts only when the time
  its cost-model FLOPs need, at the rate the cases before it ran, fits in what is left (a case too long
  is passed over, a cheaper one after it may still run); every case not run gets a `status=budget` row
  saying why;
- each case has its own deadline (`case_timeout_s`, or three times its estimate when that is longer,
  and never past the budget): a case still running then dumps every thread's stack (faulthandler) to
  stderr, gets a `status=timeout` row, and the process exits 124, so a hang says where it hung (a
  resumed run tries that case again: leave it out with `cases` to go past it).

The case list is the seed's, in order of value (`seed_cases`): Qwen3-0.6B, B=16, P=8192, R=512, unique
prompts 1, 2, 4, 8, 16 (the speedup against the dedup ratio) in split mode, then in mask mode
(FlexAttention's BlockMask on CUDA, sdpa on the CPU), then P=2048 and P=32768 in split mode, then the
micro-batch schedules at a token budget below one group (the packed baseline, zorro within each
micro-batch, and the prompt-once schedule). `shapes="tiny"` is the same list scaled down (P 64/16/256,
R 8) for a CPU check of the machinery.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from zorro_harness.bench.watchdog import Watchdog, process_age_s

SPLIT, MASK, SCHEDULE = "split", "mask", "schedule"
CPU_PEAK = "n/a (cpu: not measured in-process; zorro bench sweep measures a fresh process per arm)"


@dataclass(frozen=True)
class Shapes:
    """The sizes a case list is made of."""

    batch_size: int
    """Rows of every batch (B)."""
    prompt_lens: tuple[int, ...]
    """Prompt tokens (P): the first is the headline's, the others follow it."""
    response_len: int
    """Response tokens of every row (R)."""
    unique_prompts: tuple[int, ...]
    """Distinct prompts among the rows (U), each case's dedup ratio is 1 - U/B."""
    schedule_unique: int
    """U of the schedule case: its groups of B/U responses are each longer than the budget."""


SHAPES = {
    "seed": Shapes(16, (8192, 2048, 32768), 512, (1, 2, 4, 8, 16), 2),
    "tiny": Shapes(16, (64, 16, 256), 8, (1, 2, 4, 8, 16), 2),
}
"""`seed`: the issue's shapes (with Qwen3-0.6B); `tiny`: the same list scaled down for a CPU check."""


@dataclass(frozen=True)
class TimeCase:
    """One case of the list: a batch and how zorro computes it."""

    prompt_len: int
    response_len: int
    batch_size: int
    unique_prompts: int
    mode: str
    """"split" (varlen calls), "mask" (one masked call over the packed row) or "schedule"."""
    budget: Optional[int] = None
    """The schedule case: tokens per micro-batch (prompt + responses) of the baseline and of zorro
    within micro-batches; the prompt-once schedule gets `budget - prompt_len` response tokens, so each of
    its micro-batches holds the same responses."""

    @property
    def id(self) -> str:
        shape = f"b{self.batch_size}u{self.unique_prompts}p{self.prompt_len}r{self.response_len}"
        return f"{shape}:{self.mode}" + (f":budget{self.budget}" if self.budget is not None else "")

    @property
    def arms(self) -> tuple[str, ...]:
        """The arms timed together: the baseline first."""
        return ("baseline", "micro_batch", "prompt_once") if self.mode == SCHEDULE else ("baseline", "dedup")


def seed_cases(shapes: Shapes) -> list[TimeCase]:
    """The case list in order of value (module doc)."""
    b, r, us = shapes.batch_size, shapes.response_len, shapes.unique_prompts
    head, *others = shapes.prompt_lens
    cases = [TimeCase(head, r, b, u, SPLIT) for u in us]
    cases += [TimeCase(head, r, b, u, MASK) for u in us]
    cases += [TimeCase(p, r, b, u, SPLIT) for p in others for u in us]
    # below one group: a group is P + (B/U) R tokens; the budget holds the prompt and 3 responses
    group = head + (b // shapes.schedule_unique) * r
    budget = head + 3 * r
    if budget >= group:
        raise ValueError(f"the schedule case's budget {budget} is not below one group ({group} tokens)")
    cases.append(TimeCase(head, r, b, shapes.schedule_unique, SCHEDULE, budget))
    return cases


def select(cases: Sequence[TimeCase], patterns: Optional[str]) -> list[TimeCase]:
    """The cases whose id matches one of the comma-separated globs or substrings (all: None)."""
    if not patterns:
        return list(cases)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    return [c for c in cases if any(fnmatch.fnmatchcase(c.id, p) or p in c.id for p in pats)]


@dataclass(frozen=True)
class HarnessConfig:
    """What one run of the harness does."""

    out: Path
    """The CSV the rows are appended to."""
    model: str = "Qwen/Qwen3-0.6B"
    """A preset (or a local checkpoint's config): built with random weights on the device."""
    shapes: str = "seed"
    """A key of SHAPES."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    """Both arms' attention implementation (split mode's varlen backend follows from it)."""
    varlen_backend: Optional[str] = None
    """Split mode's backend for both arms; None: the default for the attention and device (torch's
    flash kernel pair on CUDA for sdpa), `flash_cpu` on the CPU (the pair's CPU stand-in)."""
    mask_attention: Optional[str] = None
    """Mask mode's attention; None: flex_attention on CUDA, sdpa elsewhere."""
    checkpointing: bool = True
    """Gradient checkpointing on every decoder layer, both arms (what a trainer runs at these shapes)."""
    phase: str = "forward_backward"
    """"forward_backward" (the actor update) or "forward" (log-probs under no_grad)."""
    warmup: int = 1
    rounds: int = 3
    budget_s: Optional[float] = None
    """Seconds from the harness's start after which no case starts (None: no budget)."""
    case_timeout_s: float = 600.0
    """Seconds a case may run before its stack is dumped and the run ends (status=timeout)."""
    cases: Optional[str] = None
    """Comma-separated globs or substrings of case ids (None: every case)."""
    resume: bool = False
    """Keep the CSV and skip the cases whose last row is ok or oom (otherwise the old file is backed up)."""
    seed: int = 0
    threads: int = 0
    """torch threads on the CPU (0: torch's default)."""


COLUMNS = [
    # the sweep's required columns first, so that `zorro report FILE` reads the file
    "case_id", "model", "attn_implementation", "split_attention", "logits_mode", "dtype", "device", "batch_size",
    "num_unique_prompts", "prompt_len", "response_len", "prompt_dedup_ratio", "token_redundancy", "phase",
    "baseline_ms_p50", "dedup_ms_p50", "baseline_ms_p20", "baseline_ms_p80", "dedup_ms_p20", "dedup_ms_p80",
    "speedup", "speedup_err", "baseline_tokens_per_s", "dedup_tokens_per_s", "baseline_peak_mem_mib",
    "dedup_peak_mem_mib", "peak_mem_kind", "ideal_speedup", "efficiency", "status", "error",
    "baseline_kind", "dedup_kind", "speedup_p20", "speedup_p80", "n", "warmup", "repeats", "logical_tokens",
    "unique_tokens", "baseline_gflops", "dedup_gflops", "seed", "checkpointing", "finished_utc",
    # the harness's own
    "arm", "budget_tokens", "micro_batches_baseline", "micro_batches_dedup", "baseline_plan_ms", "dedup_plan_ms",
    "self_check", "clock", "case_s",
    "process_s", "device_name", "torch_version", "transformers_version", "cuda_version",
]  # fmt: skip
"""The CSV's columns; `dedup_*` hold the row's zorro arm (`arm`: dedup, micro_batch or prompt_once)."""
DONE = ("ok", "oom")


# ---------------------------------------------------------------- the model and the clock


def build_on_device(name: str, device: torch.device, dtype: torch.dtype, attn: str, seed: int = 0) -> Any:
    """A causal LM of `name`'s config with seeded random weights, created on `device` in `dtype`:
    every parameter and buffer is allocated and initialised there (no CPU copy first)."""
    from transformers import AutoModelForCausalLM

    from zorro_core.models.presets import seeded_rng
    from zorro_harness.bench.inputs import model_config

    config = model_config(name)
    if device.type == "cuda":
        torch.cuda.init()  # seeded_rng seeds only initialised CUDA generators
    with torch.device(device), seeded_rng(seed):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    where = {t.device for t in [*model.parameters(), *model.buffers()]}
    if where != {device}:
        raise RuntimeError(f"the model was built on {sorted(map(str, where))}, not only on {device}")
    model.eval()
    return model


def clock_for(device: torch.device) -> tuple[Callable[[Callable[[], object], Any], float], str]:
    """(milliseconds of one call, the clock's name): CUDA events on a GPU, perf_counter elsewhere."""
    from zorro_harness.bench.measure import time_once

    if device.type != "cuda":
        return time_once, "perf_counter"

    def cuda_events(fn: Callable[[], object], dev: Any) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    return cuda_events, "cuda_events"


# ---------------------------------------------------------------- one case


@dataclass
class _Arms:
    """A case's callables and what its rows need besides the times."""

    calls: dict[str, Callable[[], object]]
    ideal: dict[str, float]
    """zorro arm -> the cost model's baseline FLOPs / its FLOPs."""
    gflops: dict[str, float]
    """arm -> the cost model's GFLOPs of one call."""
    parts: dict[str, int] = field(default_factory=dict)
    """arm -> micro-batches (the schedule case)."""
    workload: dict[str, Any] = field(default_factory=dict)
    actors: dict[str, Any] = field(default_factory=dict)


def _actor_config(cfg: HarnessConfig, device: torch.device, mode: str) -> Any:
    from zorro_core.actor.config import ActorConfig

    if mode == MASK:
        attn = cfg.mask_attention or ("flex_attention" if device.type == "cuda" else "sdpa")
        return ActorConfig(attn_implementation=attn, use_split_attention=False, logits_mode="compute")
    backend = cfg.varlen_backend or (None if device.type == "cuda" else "flash_cpu")
    return ActorConfig(
        attn_implementation=cfg.attn_implementation,
        use_split_attention=True,
        varlen_backend=backend,
        logits_mode="compute",
    )


def make_arms(
    cfg: HarnessConfig, model: Any, case: TimeCase, device: torch.device, cache: Optional[dict[str, Any]] = None
) -> _Arms:
    """The batch (on the device), the actors and the callables of `case`, and its cost-model figures.
    `cache`: the run's actors by kind, reused from case to case as a trainer keeps its actor (the
    self-check on CUDA then runs once per kind, in the first case's warm-up)."""
    from zorro_core.actor.actor import BaselineActor, DeduplicatedActor
    from zorro_core.actor.microbatch import micro_batch_partition
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.balance import select_rows
    from zorro_core.plan.batch import create_dummy_batch
    from zorro_core.plan.cost import compare_plans, flops, plan_workload

    batch = create_dummy_batch(
        batch_size=case.batch_size,
        num_unique_prompts=case.unique_prompts,
        prompt_len=case.prompt_len,
        response_len=case.response_len,
        vocab_size=model.config.vocab_size,
        device=str(device),
        seed=cfg.seed,
    )
    cache = {} if cache is None else cache
    if "baseline" not in cache:
        cache["baseline"] = BaselineActor(model=model, config=_actor_config(cfg, device, SPLIT))
    kind = MASK if case.mode == MASK else SPLIT
    if kind not in cache:
        cache[kind] = DeduplicatedActor(model=model, config=_actor_config(cfg, device, kind))
    baseline, dedup = cache["baseline"], cache[kind]
    n = batch.response_mask.sum()
    shape = model_shape(model.config)
    # each arm's plan, timed once (its forward builds it again every call: a host term beside the kernels)
    plans, plan_ms = {}, {}
    for name, actor in (("baseline", baseline), ("dedup", dedup)):
        _synchronize(device)
        t = time.perf_counter()
        plans[name] = actor.plan(batch)
        _synchronize(device)
        plan_ms[name] = round((time.perf_counter() - t) * 1e3, 2)
    base_plan, dedup_plan = plans["baseline"], plans["dedup"]
    cmp = compare_plans(shape, base_plan, dedup_plan, "compute")
    workload = {
        "prompt_dedup_ratio": round(1.0 - case.unique_prompts / case.batch_size, 6),
        "token_redundancy": round(dedup_plan.token_redundancy, 6),
        "logical_tokens": dedup_plan.logical_tokens,
        "unique_tokens": dedup_plan.num_tokens,
        "baseline_plan_ms": plan_ms["baseline"],
        "dedup_plan_ms": plan_ms["dedup"],
    }
    actors = {"baseline": baseline, "dedup": dedup}
    if case.mode != SCHEDULE:
        phase = cfg.phase

        def step(actor: Any) -> Callable[[], object]:
            def forward() -> None:
                with torch.no_grad():
                    actor.forward(batch)

            def forward_backward() -> None:
                (actor.forward(batch).log_probs.sum() / n).backward()

            return forward if phase == "forward" else forward_backward

        gf = {"baseline": cmp.baseline.phase(phase) / 1e9, "dedup": cmp.dedup.phase(phase) / 1e9}
        return _Arms(
            {"baseline": step(baseline), "dedup": step(dedup)},
            {"dedup": cmp.ideal_speedup(phase)},
            gf,
            workload=workload,
            actors=actors,
        )
    assert case.budget is not None
    budget, po_budget = case.budget, case.budget - case.prompt_len

    def loss_fn(out: Any, rows: torch.Tensor) -> torch.Tensor:
        return out.log_probs.sum() / n

    def fb_of(actor: Any, parts: list[list[int]]) -> float:
        plans = [actor.plan(select_rows(batch, torch.tensor(rows, device=device))) for rows in parts]
        return sum(flops(shape, plan_workload(p)).forward_backward for p in plans) / 1e9

    parts = {
        "baseline": micro_batch_partition(baseline, batch, budget).parts,
        "micro_batch": micro_batch_partition(dedup, batch, budget).parts,
    }
    gf = {a: fb_of(actors["baseline" if a == "baseline" else "dedup"], p) for a, p in parts.items()}
    # each prompt once per step: the whole batch's dedup plan (phase 1 and every response micro-batch)
    gf["prompt_once"] = fb_of(dedup, [list(range(batch.batch_size))])
    from zorro_core.actor.schedule import Groups, response_micro_batches

    po_parts = len(response_micro_batches(Groups.of(batch), po_budget))
    calls = {
        "baseline": lambda: baseline.forward_backward(batch, loss_fn, budget),
        "micro_batch": lambda: dedup.forward_backward(batch, loss_fn, budget, schedule="micro_batch"),
        "prompt_once": lambda: dedup.forward_backward(batch, loss_fn, po_budget, schedule="prompt_once"),
    }
    return _Arms(
        calls,
        {a: gf["baseline"] / gf[a] for a in ("micro_batch", "prompt_once")},
        gf,
        {"baseline": len(parts["baseline"]), "micro_batch": len(parts["micro_batch"]), "prompt_once": po_parts},
        workload,
        actors,
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _free(model: Any, device: torch.device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _kind(actor: Any) -> str:
    if not actor.dedup:
        return f"packed_varlen_{actor.varlen_backend}"
    if actor.config.use_split_attention:
        return f"split_{actor.varlen_backend}"
    return f"mask_{actor.attn_implementation}"


def _self_check(actor: Any) -> str:
    sc = actor.self_check
    if not sc.enabled:
        return "off"
    if sc.skipped:
        return f"skipped: {sc.skipped}"
    if sc.failed is not None:
        return f"FAILED (the arm ran its fallback): {sc.failed.describe()}"
    return "pass" if sc.verdicts else "not run"


def time_case(
    cfg: HarnessConfig, model: Any, case: TimeCase, device: torch.device, cache: Optional[dict[str, Any]] = None
) -> list[dict[str, Any]]:
    """The rows of one case (one per zorro arm): warm-up (each arm's first call is its peak), then
    the arms timed interleaved; an arm out of memory in its warm-up is dropped, the others timed."""
    from zorro_harness.bench.measure import speedup_columns, summarize, time_columns, time_interleaved

    arms = make_arms(cfg, model, case, device, cache)
    clock, clock_name = clock_for(device)
    peaks: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name, fn in arms.calls.items():
        failure = None
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            model.zero_grad(set_to_none=True)
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                peaks[name] = torch.cuda.max_memory_allocated(device) / 2**20
        except Exception as e:  # noqa: BLE001 - out of memory is a row; anything else ends the case
            if not _is_oom(e):
                raise
            failure = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
        if failure is not None:  # outside the except block: its traceback no longer holds the arm's tensors
            errors[name] = failure
            _free(model, device)
    timed = {a: f for a, f in arms.calls.items() if a not in errors}
    times: dict[str, list[float]] = {}
    if timed:
        times = time_interleaved(
            timed,
            device,
            warmup=max(cfg.warmup - 1, 0),
            repeats=cfg.rounds,
            between=lambda: model.zero_grad(set_to_none=True),
            clock=clock,
        )
    _free(model, device)
    kinds = {a: _kind(arms.actors["baseline" if a == "baseline" else "dedup"]) for a in case.arms}
    if case.mode == SCHEDULE:
        kinds = {a: f"{a}_{k}" for a, k in kinds.items()}
    rows = []
    for arm in case.arms[1:]:
        row: dict[str, Any] = {
            "case_id": case.id if case.mode != SCHEDULE else f"{case.id}:{arm}",
            "model": cfg.model,
            "attn_implementation": arms.actors["dedup"].attn_implementation,
            "split_attention": case.mode != MASK,
            "logits_mode": "compute",
            "dtype": cfg.dtype,
            "device": str(device),
            "batch_size": case.batch_size,
            "num_unique_prompts": case.unique_prompts,
            "prompt_len": case.prompt_len,
            "response_len": case.response_len,
            "phase": "forward_backward" if case.mode == SCHEDULE else cfg.phase,
            **arms.workload,
            "ideal_speedup": round(arms.ideal[arm], 4),
            "baseline_gflops": round(arms.gflops["baseline"], 3),
            "dedup_gflops": round(arms.gflops[arm], 3),
            "baseline_kind": kinds["baseline"],
            "dedup_kind": kinds[arm],
            "warmup": cfg.warmup,
            "repeats": cfg.rounds,
            "seed": cfg.seed,
            "checkpointing": cfg.checkpointing,
            "arm": arm,
            "budget_tokens": case.budget if case.budget is not None else "",
            "micro_batches_baseline": arms.parts.get("baseline", ""),
            "micro_batches_dedup": arms.parts.get(arm, ""),
            "self_check": _self_check(arms.actors["dedup"]),
            "clock": clock_name,
            "peak_mem_kind": "cuda_max_memory_allocated_first_call" if device.type == "cuda" else CPU_PEAK,
        }
        for name, col in (("baseline", "baseline"), (arm, "dedup")):
            if name in times:
                s = summarize(times[name])
                row.update(time_columns(col, s))
                row[f"{col}_tokens_per_s"] = round(arms.workload["logical_tokens"] / (s.p50 / 1e3), 1)
                row["n"] = s.n
            if name in peaks:
                row[f"{col}_peak_mem_mib"] = round(peaks[name], 1)
        if "baseline" in times and arm in times:
            row.update(speedup_columns(times["baseline"], times[arm], arms.ideal[arm]))
        bad = {a: errors[a] for a in ("baseline", arm) if a in errors}
        row["status"] = "oom" if bad else "ok"
        row["error"] = "; ".join(f"{a}: {e}" for a, e in bad.items())
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the run


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name}: CUDA is not available here (use --device cpu)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _base_row(cfg: HarnessConfig, case: TimeCase, status: str, error: str) -> dict[str, Any]:
    return {
        "case_id": case.id,
        "model": cfg.model,
        "dtype": cfg.dtype,
        "device": cfg.device,
        "batch_size": case.batch_size,
        "num_unique_prompts": case.unique_prompts,
        "prompt_len": case.prompt_len,
        "response_len": case.response_len,
        "split_attention": case.mode != MASK,
        "phase": "forward_backward" if case.mode == SCHEDULE else cfg.phase,
        "budget_tokens": case.budget if case.budget is not None else "",
        "status": status,
        "error": error,
    }


def _gflops_estimate(model: Any, case: TimeCase, cfg: HarnessConfig) -> float:
    """The cost model's GFLOPs of the whole case (every arm, warm-up and rounds), from shapes alone:
    the budget's measure of what a case will take."""
    from zorro_core.models.registry import model_shape
    from zorro_core.plan.cost import flops, uniform_workloads

    shape = model_shape(model.config)
    group = case.batch_size // case.unique_prompts
    base, dedup = uniform_workloads(case.prompt_len, case.unique_prompts, group, case.response_len)
    per = [flops(shape, w).phase(cfg.phase if case.mode != SCHEDULE else "forward_backward") for w in (base, dedup)]
    arms = per + ([per[1]] if case.mode == SCHEDULE else [])
    return sum(arms) / 1e9 * (cfg.warmup + cfg.rounds)


class Harness:
    """One run: the model, the CSV, the clock of the budget, the rows so far."""

    def __init__(self, cfg: HarnessConfig, echo: Callable[[str], None] = print) -> None:
        from zorro_harness.bench.results import ResultWriter, backup, done_keys

        if cfg.shapes not in SHAPES:
            raise ValueError(f"unknown shapes {cfg.shapes!r}; choose one of {sorted(SHAPES)}")
        if cfg.phase not in ("forward", "forward_backward"):
            raise ValueError(f"phase must be forward or forward_backward, got {cfg.phase!r}")
        if cfg.rounds < 1 or cfg.warmup < 1:
            raise ValueError(
                f"need rounds >= 1 and warmup >= 1 (the first warm-up is the peak), got {cfg.rounds}, {cfg.warmup}"
            )
        self.cfg = cfg
        self.echo = echo
        self.start = time.perf_counter()
        self.cases = select(seed_cases(SHAPES[cfg.shapes]), cfg.cases)
        if not self.cases:
            raise ValueError(f"no case matches {cfg.cases!r}")
        out = Path(cfg.out)
        done = done_keys(out) if cfg.resume and out.exists() else set()
        if not cfg.resume and out.exists() and out.stat().st_size:
            kept = backup(out)
            echo(f"the old {out} is kept as {kept}")
        self.writer = ResultWriter(out, COLUMNS, COLUMNS)
        self.done = done
        self.rows: list[dict[str, Any]] = []
        self.rate: Optional[float] = None
        """Seconds per cost-model GFLOP of the cases run so far (the budget's estimate)."""

    def left(self) -> Optional[float]:
        if self.cfg.budget_s is None:
            return None
        return self.cfg.budget_s - (time.perf_counter() - self.start)

    def write(self, row: dict[str, Any]) -> None:
        row = dict(row)
        row.setdefault("finished_utc", dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"))
        row.setdefault("process_s", round(process_age_s(), 2))
        row.setdefault("torch_version", torch.__version__)
        row.setdefault("transformers_version", _transformers_version())
        row.setdefault("cuda_version", torch.version.cuda or "")
        self.writer.append(row)
        self.rows.append(row)
        self.echo(_line(row))

    def _is_done(self, case: TimeCase) -> bool:
        phase = "forward_backward" if case.mode == SCHEDULE else self.cfg.phase
        ids = [f"{case.id}:{a}" for a in case.arms[1:]] if case.mode == SCHEDULE else [case.id]
        return all((i, phase) in self.done for i in ids)

    def run(self) -> list[dict[str, Any]]:
        cfg = self.cfg
        todo = [c for c in self.cases if not self._is_done(c)]
        for c in self.cases:
            if c not in todo:
                self.echo(f"{c.id}: done before (--resume), skipped")
        if not todo:
            return self.rows
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        from zorro_core.plan.dtypes import DTYPES

        device = _device(cfg.device)
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        t = time.perf_counter()
        try:
            model = build_on_device(cfg.model, device, DTYPES[cfg.dtype], cfg.attn_implementation, cfg.seed)
            if cfg.checkpointing:
                from zorro_core.stack.checkpointing import enable_checkpointing

                enable_checkpointing(model, "non-reentrant")
                model.train()
        except Exception as e:  # noqa: BLE001 - every case's row says why nothing ran
            why = f"the model could not be built on {device}: {type(e).__name__}: {str(e).strip()[:300]}"
            for case in todo:
                self.write(_base_row(cfg, case, "error", why))
            return self.rows
        cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
        self.echo(
            f"model {cfg.model} built on {device} ({device_name}) in {cfg.dtype} in {time.perf_counter() - t:.2f} s; "
            f"{process_age_s():.1f} s since the process started (torch {torch.__version__}, transformers "
            f"{_transformers_version()}{cuda})"
        )
        actors: dict[str, Any] = {}
        for i, case in enumerate(todo):
            left = self.left()
            if left is not None and left <= 0:
                why = f"not run: the {cfg.budget_s:g} s budget is spent"
                for rest in todo[i:]:
                    self.write(_base_row(cfg, rest, "budget", why))
                break
            need = self.rate * _gflops_estimate(model, case, cfg) if self.rate is not None else 0.0
            if left is not None and self.rate is not None:
                # a case too long for what is left is passed over; a cheaper one after it may still fit
                if need > left:
                    why = f"not run: {left:.1f} s of the {cfg.budget_s:g} s budget left, the case needs ~{need:.1f} s"
                    self.write(_base_row(cfg, case, "budget", why + " (estimated from the cases before it)"))
                    continue
            # the deadline catches a hang: a case the estimate says is long gets three times its estimate
            deadline = max(cfg.case_timeout_s, 3 * need)
            deadline = deadline if left is None else min(deadline, max(left, 1.0))

            def expired(case: TimeCase = case, deadline: float = deadline) -> None:
                why = f"still running after {deadline:.0f} s: every thread's stack is on stderr above"
                self.write(_base_row(cfg, case, "timeout", why))

            t0 = time.perf_counter()
            try:
                with Watchdog(deadline, expired):
                    rows = time_case(cfg, model, case, device, actors)
            except Exception as e:  # noqa: BLE001 - a failed case is a row, the next case runs
                text = str(e).strip()
                rows = [
                    _base_row(cfg, case, "error", f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:500])
                ]
                _free(model, device)
            took = time.perf_counter() - t0
            for row in rows:
                row.update(case_s=round(took, 2), device_name=device_name)
                self.write(row)
            if all(r["status"] == "ok" for r in rows):
                self.rate = took / max(_gflops_estimate(model, case, cfg), 1e-9)
        return self.rows


def _transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _line(row: dict[str, Any]) -> str:
    """One printed line per row: what the table shows."""
    if row.get("status") != "ok":
        return f"{row['case_id']}: {row.get('status')} {row.get('error', '')}".rstrip()

    def f(key: str, fmt: str = "{:.2f}") -> str:
        v = row.get(key)
        return "-" if v in (None, "") else fmt.format(float(v))

    return (
        f"{row['case_id']}: baseline {f('baseline_ms_p50')} ms, {row.get('arm')} {f('dedup_ms_p50')} ms, "
        f"speedup {f('speedup')}x [p20 {f('speedup_p20')}, p80 {f('speedup_p80')}], ideal {f('ideal_speedup')}x, "
        f"efficiency {f('efficiency')}; peak MiB {f('baseline_peak_mem_mib', '{:.0f}')}/"
        f"{f('dedup_peak_mem_mib', '{:.0f}')}; self-check {row.get('self_check')}; {row.get('process_s')} s"
    )


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as the README's table: median, spread (p20-p80 of the paired ratios), ideal."""
    out = [
        "| case | dedup ratio | baseline ms | zorro ms | speedup [p20, p80] | ideal | efficiency | peak MiB b/z | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = (
            f"{float(r['speedup']):.2f}x [{float(r['speedup_p20']):.2f}, {float(r['speedup_p80']):.2f}]"
            if r.get("speedup") not in (None, "")
            else "-"
        )
        out.append(
            f"| {r['case_id']} | {r.get('prompt_dedup_ratio', '')} | {r.get('baseline_ms_p50', '')} | "
            f"{r.get('dedup_ms_p50', '')} | {sp} | {r.get('ideal_speedup', '')} | {r.get('efficiency', '')} | "
            f"{r.get('baseline_peak_mem_mib', '') or '-'}/{r.get('dedup_peak_mem_mib', '') or '-'} | {r.get('status')} |"
        )
    return "\n".join(out)


def run_harness(cfg: HarnessConfig, echo: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run the harness (module doc); the rows written by this run."""
    from zorro_harness.bench.results import ResultsLock

    with ResultsLock(cfg.out):
        return Harness(cfg, echo).run()


def parse_config(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> tuple[HarnessConfig, bool]:
    """(the config, --list) from the command line of `python -m zorro_harness.bench.gpu_time`."""
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog=prog or "python -m zorro_harness.bench.gpu_time", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="results/gpu_time.csv", help="the CSV rows are appended to")
    ap.add_argument("--model", default=None, help="preset (default: Qwen/Qwen3-0.6B; tiny-qwen3 with --shapes tiny)")
    ap.add_argument("--shapes", default=None, choices=sorted(SHAPES), help="default: seed on CUDA, tiny on the CPU")
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--attn-implementation", default="sdpa")
    ap.add_argument("--varlen-backend", default=None)
    ap.add_argument("--mask-attention", default=None)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--phase", default="forward_backward", choices=("forward", "forward_backward"))
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=None, help="no case starts past this (seconds from the start)")
    ap.add_argument("--case-timeout-s", type=float, default=600.0)
    ap.add_argument("--cases", default=None, help="comma-separated globs or substrings of case ids")
    ap.add_argument("--resume", action="store_true", help="skip the cases whose last row is ok or oom")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: 1 on the CPU, as the suites; torch's on CUDA)",
    )
    ap.add_argument("--list", action="store_true", help="print the case ids and exit")
    a = ap.parse_args(argv)
    on_cuda = torch.device(a.device).type == "cuda"
    shapes = a.shapes or ("seed" if on_cuda else "tiny")
    cfg = HarnessConfig(
        out=Path(a.out),
        model=a.model or ("Qwen/Qwen3-0.6B" if shapes == "seed" else "tiny-qwen3"),
        shapes=shapes,
        device=a.device,
        dtype=a.dtype or ("bfloat16" if on_cuda else "float32"),
        attn_implementation=a.attn_implementation,
        varlen_backend=a.varlen_backend,
        mask_attention=a.mask_attention,
        checkpointing=not a.no_checkpointing,
        phase=a.phase,
        warmup=a.warmup,
        rounds=a.rounds,
        budget_s=a.budget_s,
        case_timeout_s=a.case_timeout_s,
        cases=a.cases,
        resume=a.resume,
        threads=a.threads if a.threads is not None else (0 if on_cuda else 1),
    )
    return cfg, a.list


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """The command line: 0 when every row is ok, 1 when one is not (oom, error, budget), 2 on bad input."""
    cfg, list_only = parse_config(argv, prog)
    if list_only:
        print("\n".join(c.id for c in select(seed_cases(SHAPES[cfg.shapes]), cfg.cases)))
        return 0
    try:
        rows = run_harness(cfg, lambda s: print(s, flush=True))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(rows), flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["HarnessConfig", "TimeCase", "Watchdog", "build_on_device", "run_harness", "seed_cases"]
