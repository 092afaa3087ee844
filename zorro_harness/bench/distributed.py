"""Benchmark cases with `nproc` > 1: data-parallel ranks, with and without `regroup`.

The case's batch is the GLOBAL batch. Its rows are dealt to the ranks round-robin by group
(rows sorted by prompt, then dealt), so every prompt is cut across the ranks the way a trainer's
shuffle cuts it: with B=16 = 2 prompts x 8 rows on 2 ranks, each rank starts with 4 rows of each
prompt. The model is sharded with `fully_shard` (each decoder layer and the root), as a trainer
wraps it. Both arms run the deduplicated actor on every rank:
- baseline arm, `no_regroup`: each rank on its own rows (dedup within the rank only);
- dedup arm, `regroup`: regroup (metadata all_gather + rows all_to_all), the actor on the
  regrouped rows, `restore` to the rank's own rows (and its inverse in backward): the
  communication is inside the timed step.
One step is timed from a barrier to a barrier, so it lasts as long as the slowest rank; the arms
alternate (ABBA) in the same processes. The ideal speedup is the cost model's: FLOPs of the most
loaded rank without regroup / with regroup. Each case is its own process tree: the N ranks are
fresh processes (zorro_core.distributed.launch), nothing is reused between cases.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.distributed import regroup
from zorro_core.distributed.launch import default_backend, launch
from zorro_core.distributed.regroup import prompt_keys
from zorro_core.distributed.routing import plan_routing
from zorro_core.models.presets import load_model
from zorro_core.models.registry import model_shape
from zorro_core.plan.balance import select_rows
from zorro_core.plan.build import build_dedup_plan
from zorro_core.plan.cost import flops, plan_workload
from zorro_core.plan.dtypes import DTYPES
from zorro_core.verify.distributed import rank_rows
from zorro_harness.bench.guard import ranks_over_cores, ranks_over_memory
from zorro_harness.bench.inputs import make_batch, model_config
from zorro_harness.bench.measure import Stats, speedup_columns, summarize, time_columns, time_interleaved
from zorro_harness.bench.suite import PHASES, Case, Measure

ARMS = ("no_regroup", "regroup")


def rank_batches(case: Case, vocab_size: int) -> tuple[Any, list[list[int]]]:
    """The global batch and each rank's rows (dealt round-robin by group)."""
    batch = make_batch(case, vocab_size)
    if batch.batch_size < case.nproc:
        raise ValueError(f"batch_size {batch.batch_size} < nproc {case.nproc}: a rank would hold no rows")
    return batch, [rank_rows(batch, r, case.nproc) for r in range(case.nproc)]


def case_plan(case: Case) -> dict[str, Any]:
    """Per rank, before and after regrouping: rows, prompt dedup ratio and the cost model's FLOPs;
    the single-process dedup ratio; the ideal speedup of regrouping per phase. No process starts."""
    config = model_config(case.model)
    shape = model_shape(config)
    batch, rows = rank_batches(case, config.vocab_size)
    parts = [select_rows(batch, r) for r in rows]
    routing = plan_routing(
        [prompt_keys(p) for p in parts],
        [p.prompt_mask.bool().sum(1).tolist() for p in parts],
        [p.response_mask.bool().sum(1).tolist() for p in parts],
        equal_rows=False,
    )
    flat = [i for r in rows for i in r]  # routing's global row k is batch row flat[k]

    def cost(rank_rows: list[int]) -> dict[str, float]:
        f = flops(
            shape,
            plan_workload(build_dedup_plan(select_rows(batch, rank_rows)), case.actor.logits_mode),
            case.actor.logits_mode,
        )
        return {p: f.phase(p) for p in PHASES}

    before = [cost(r) for r in rows]
    after = [cost([flat[k] for k in routing.rows_on(r)]) for r in range(case.nproc)]
    return {
        "rows_before": routing.rows_before,
        "rows_after": routing.rows_after,
        "prompt_dedup_before": routing.prompt_dedup_ratio(after=False),
        "prompt_dedup_after": routing.prompt_dedup_ratio(after=True),
        "single_process_prompt_dedup": build_dedup_plan(batch).prompt_dedup_ratio,
        "gflops_before": {p: max(c[p] for c in before) / 1e9 for p in PHASES},
        "gflops_after": {p: max(c[p] for c in after) / 1e9 for p in PHASES},
        "ideal_speedup": {p: max(c[p] for c in before) / max(c[p] for c in after) for p in PHASES},
    }


def _shard(model) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def rank_process(case: Case, measure: Measure) -> dict[str, Any]:
    """One rank of a case (inside its process group): both arms timed interleaved, per phase."""
    rank = dist.get_rank()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if case.device.startswith("cuda") else "cpu")
    model = load_model(
        case.model,
        device=device,
        dtype=DTYPES[case.dtype],
        attn_implementation=str(case.actor.attn_implementation),  # a Case always names one
        seed=case.seed,
    )
    model.eval()
    _shard(model)
    for m in model.modules():  # the loss below is normalised over the global batch: FSDP sums
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    actor = DeduplicatedActor(model=model, config=case.actor_config(sharing="prompt"))
    batch, rows = rank_batches(case, model.config.vocab_size)
    mine = select_rows(batch, rows[rank]).to(device)
    n_global = int(batch.response_mask.sum())
    infos: list = []

    def step(use_regroup: bool, backward: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(backward):
                if use_regroup:
                    local, restore = regroup(mine)
                    lp = restore(actor.forward(local).log_probs)
                    infos[:] = [restore.info]
                else:
                    lp = actor.forward(mine).log_probs
                if backward:
                    (lp.sum() / n_global).backward()
            dist.barrier()  # the step lasts until the slowest rank is done

        return run

    def between() -> None:
        model.zero_grad(set_to_none=True)
        dist.barrier()  # every rank starts the step together

    out: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads(), "phases": {}}
    for phase in measure.phases:
        backward = phase == "forward_backward"
        arms = {"no_regroup": step(False, backward), "regroup": step(True, backward)}
        out["phases"][phase] = time_interleaved(
            arms, device, warmup=max(1, measure.warmup), repeats=measure.repeats, between=between
        )
    info = infos[0]
    out["bytes"] = {
        "rows": info.bytes_sent,
        "metadata": info.metadata_bytes,
        "restore_per_step": info.restore_bytes_sent,
    }
    return out


def distributed_case_rows(
    case: Case, measure: Measure, base: dict[str, Any], on_phase: Callable[[dict], None] | None = None
) -> list[dict[str, Any]]:
    """The rows of an nproc > 1 case (one per phase); a failure becomes the rows' status."""
    base = dict(
        base,
        nproc=case.nproc,
        baseline_kind="dedup_no_regroup",
        dedup_kind="dedup_regroup",
        threads=measure.threads or 1,
    )
    try:
        plan = case_plan(case)
    except Exception as e:  # noqa: BLE001 -- a bad case is a row, the sweep goes on
        return _emit_all(
            [dict(base, phase=p, status="error", error=f"{type(e).__name__}: {e}") for p in measure.phases], on_phase
        )
    base.update(
        rows_per_rank_before=" ".join(map(str, plan["rows_before"])),
        rows_per_rank_after=" ".join(map(str, plan["rows_after"])),
        prompt_dedup_per_rank_before=" ".join(f"{x:.4f}" for x in plan["prompt_dedup_before"]),
        prompt_dedup_per_rank_after=" ".join(f"{x:.4f}" for x in plan["prompt_dedup_after"]),
        prompt_dedup_ratio=round(plan["single_process_prompt_dedup"], 6),
    )
    status, error, results = "ok", "", []
    width = getattr(torch, case.dtype).itemsize
    if case.device.startswith("cuda") and torch.cuda.device_count() < case.nproc:
        status, error = "skipped", f"{case.nproc} ranks need {case.nproc} GPUs, {torch.cuda.device_count()} here"
    elif why := ranks_over_cores(case.nproc, flag="nproc"):
        status, error = "skipped", why
    elif why := ranks_over_memory(case.nproc, case.model, width, flag="nproc"):
        status, error = "oom", f"refused before running: {why}"
    else:
        try:
            results = launch(
                rank_process,
                case.nproc,
                case,
                measure,
                backend=default_backend(case.device),
                threads=measure.threads or 1,
                timeout_s=measure.timeout_s,
            )
        except TimeoutError as e:
            status, error = "timeout", str(e)
        except Exception as e:  # noqa: BLE001 -- a failed case is a row, the sweep goes on
            status, error = "error", str(e).strip().splitlines()[-1][:500] if str(e).strip() else type(e).__name__
    rows = []
    for phase in measure.phases:
        row = dict(
            base,
            phase=phase,
            status=status,
            error=error,
            ideal_speedup=round(plan["ideal_speedup"][phase], 4),
            baseline_gflops=round(plan["gflops_before"][phase], 3),
            dedup_gflops=round(plan["gflops_after"][phase], 3),
        )
        if results:
            _fill(row, results, phase, plan["ideal_speedup"][phase])
        rows.append(row)
    return _emit_all(rows, on_phase)


def _fill(row: dict, results: list[dict], phase: str, ideal: float) -> None:
    times = results[0]["phases"][phase]  # rank 0's clock: every step ends at a barrier
    stats: dict[str, Stats] = {arm: summarize(times[arm]) for arm in ARMS}
    for key, arm in (("baseline", "no_regroup"), ("dedup", "regroup")):
        s = stats[arm]
        row.update(time_columns(key, s))
        row["n"] = s.n
    row.update(speedup_columns(times["no_regroup"], times["regroup"], ideal))
    row.update(
        threads=results[0]["threads"],
        regroup_bytes_sent=sum(r["bytes"]["rows"] for r in results),
        regroup_metadata_bytes=sum(r["bytes"]["metadata"] for r in results),
        restore_bytes_per_step=sum(r["bytes"]["restore_per_step"] for r in results)
        * (2 if phase == "forward_backward" else 1),
    )


def _emit_all(rows: list[dict], on_phase) -> list[dict]:
    if on_phase is not None:
        for r in rows:
            on_phase(r)
    return rows
