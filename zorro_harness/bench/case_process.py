"""What runs inside a benchmark case's processes (runner.py starts them, isolation.py guards them).

- The workload process computes the case's Workload (tokens, redundancy, the cost model's ideal
  speedup) from its config and batch, without weights.
- The timing process builds the model, the batch and both actors, then times baseline and dedup
  interleaved for each phase (measure.time_interleaved: a speedup is a ratio from one run); an arm
  that runs out of memory in its warm-up is dropped and the other still timed. On CUDA it also
  reads max_memory_allocated for each arm.
- A CPU memory process runs one arm and phase cold, then reads its peak RSS (see measure.py).
Each sends a dict back through its pipe; a raise is sent as {"error", "status"} (never lost).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from zorro_core.actor.actor import BaselineActor, DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.models.presets import load_model
from zorro_core.models.registry import model_shape
from zorro_core.plan.build import build_dedup_plan, build_plain_plan
from zorro_core.plan.cost import compare_plans
from zorro_core.plan.dtypes import DTYPES
from zorro_core.stack.auto import choose_attention
from zorro_core.stack.checkpointing import enable_checkpointing
from zorro_core.stack.liger import apply_liger, liger_unavailable
from zorro_harness.bench.inputs import make_batch, model_config
from zorro_harness.bench.measure import (
    peak_memory_mib,
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
