"""The prompt-once schedule in zorro's verl engine: a mini-batch's prompts computed once, however
many micro-batches their responses take (zorro_core.actor.schedule; docs/schedule.md).

Turned on by the engine's actor options, as every zorro option in verl is: an `external_lib`
module of the user's calls `install(zorro_config=ActorConfig(schedule="prompt_once"))`
(zorro_core.integrations.verl.engine). Then `DedupFSDPEngine.forward_backward_batch` runs
`prompt_once_batch` for training (`prompt_once_step`) and for log-prob passes
(`prompt_once_logprobs`) in place of verl's loop over micro-batches:

- micro-batches are response micro-batches: with `use_dynamic_bsz` cut by verl's
  `max_token_len_per_gpu` counted in response tokens (the only tokens phase 2 computes); with a
  fixed `micro_batch_size_per_gpu`, that many rows each, rows of a prompt next to each other. Every
  data-parallel rank runs the same number (verl's `same_micro_num_in_dp`: FSDP's collectives must
  pair up), a rank's largest micro-batch halved until it has the agreed count.
- each micro-batch's loss is verl's own `loss_function(model_output=..., data=micro_batch,
  dp_group=...)` on zorro's log-probs (entropy) in verl's nested layout and dtype, under the
  engine's autocast; verl's losses are sums normalised by global counts (`batch_num_tokens`,
  `dp_size`, `global_batch_size`, set here as verl's loop sets them), so the gradient does not
  depend on which rows share a micro-batch.
- FSDP2: the gradient sync is off through phase 2's backwards and on for phase 3, the prompts'
  backward: one reduction per mini-batch (verl's `use_no_sync_for_gradient_accumulation`, which
  defaults to deferring; when it is False every backward syncs, as in verl).
- outputs: verl's `postprocess_batch_func` over the micro-batches' outputs, back in the batch's
  row order; the pass's "zorro/..." metrics count the schedule (`schedule_metrics`).

Where the schedule cannot serve a mini-batch it is handed back to the within-micro-batch path
(the engine's usual `forward_backward_batch`, which may itself hand micro-batches to verl's
forward) with a one-time `DedupFallbackWarning` naming the reason: what the library refuses
(`schedule_refusal`: prefix sharing, linear-attention layers, the MoE router aux loss), Ulysses
sequence parallelism, anything zorro's forward would not serve (multi-modal inputs, fused
kernels, ...), a row with an empty response, `force_group_size`, fewer rows on some rank than the
agreed micro-batch count. The ranks agree first, so all of them take the same path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

import zorro_core.integrations.verl.needs  # noqa: F401 -- first: refuses a missing or too old verl

# isort: split
from verl.utils import tensordict_utils as tu
from verl.utils.device import get_device_id, get_device_name
from verl.utils.fsdp_utils import fsdp_version
from verl.workers.engine import utils as engine_utils

from zorro_core.actor.schedule import (
    Groups,
    ScheduleOutput,
    prompt_once_logprobs,
    prompt_once_step,
    response_micro_batches,
    schedule_refusal,
)
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.verl.metrics import MicroBatchStats
from zorro_core.integrations.verl.rows import (
    REFUSED,
    VerlRows,
    flag,
    rows_of,
    temperature_of,
    unserved_reason,
)

__all__ = ["AUTO_WITHIN", "HANDED_BACK", "ScheduleStats", "prompt_once_batch", "schedule_metrics", "schedule_parts"]

HANDED_BACK = "the within-micro-batch path serves this mini-batch"
"""What the engine's one-time warning says runs instead of the schedule."""
OTHER_RANK = "another data-parallel rank cannot run the prompt-once schedule on its rows"
AUTO_WITHIN = object()
"""prompt_once_batch's answer where schedule="auto" chose the within-micro-batch path (a choice, not a fallback)."""


@dataclass(frozen=True)
class ScheduleStats:
    """What one pass under the schedule computed, against the plain and within-micro-batch paths."""

    prompts: int
    """Unique prompts computed (phase 1), each once."""
    rows: int
    """Rows: the prompts the plain computation runs (one per row)."""
    prompt_tokens: int
    """Prompt tokens computed (phase 1)."""
    prompt_tokens_plain: int
    """Prompt tokens of the rows, each row's own (the plain computation)."""
    prompt_tokens_micro_batch: int
    """Prompt tokens within-micro-batch dedup computes on the same micro-batches (each prompt once per
    micro-batch holding its responses)."""
    split_groups: int
    """Groups whose responses span more than one micro-batch."""
    kept_bytes: int
    """Bytes of the kept keys and values (and first-token hidden states) of the largest wave."""
    waves: int = 1
    """Waves the pass ran (zorro_core.actor.waves): phases 1-3 per wave."""
    oversize_waves: int = 0
    """Waves of one group (or tied groups) whose prompt tokens alone exceed the wave bound."""
    phase1_max_tokens: int = 0
    """Tokens of the largest phase-1 call (at most the budget, but for gated DeltaNet layers)."""


def _data_parallel(engine) -> Optional[Any]:
    return engine.get_data_parallel_group() if dist.is_available() and dist.is_initialized() else None


def _agree_max(values: list[int], group) -> list[int]:
    """The element-wise maximum over the data-parallel ranks (the values unchanged without a group)."""
    if group is None:
        return values
    t = torch.tensor(values, dtype=torch.long, device=get_device_name())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(x) for x in t.cpu().tolist()]


def _local_reason(engine, data) -> Optional[str]:
    """Why this rank's rows cannot run the schedule (None: they can)."""
    if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        return "force_group_size (verl's fixed row groups per micro-batch)"
    if engine.use_ulysses_sp:
        return "Ulysses sequence parallelism (the prompt-once schedule runs without it)"
    if not data["input_ids"].is_nested:
        return "input_ids is not a nested (no-padding) tensor"
    reason = unserved_reason(engine, data)
    if reason is not None:
        return reason
    if engine._zorro_fallback.has_fallen_back(REFUSED):
        return "the dedup path refused the model"
    if engine.__dict__.get("_zorro_schedule_refused"):
        return engine._zorro_schedule_refused
    if "temperature" in data.keys() and isinstance(temperature_of(data), str):
        return str(temperature_of(data))
    rows = rows_of(data)
    if isinstance(rows, str):
        return rows
    if rows.live.numel() != len(data):
        return "a row with an empty response (the schedule runs response rows only)"
    try:
        return schedule_refusal(engine._zorro_actor())
    except UnsupportedModelError as e:
        return f"{REFUSED}: {e}"


def schedule_parts(groups: Groups, data, k: Optional[int] = None) -> list[list[int]]:
    """The rank's response micro-batches (rows of a prompt next to each other): `use_dynamic_bsz`
    cuts by `max_token_len_per_gpu` in response tokens, else `micro_batch_size_per_gpu` rows each;
    with `k`, the part with the most response tokens halved (in group order) until there are k."""
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        parts = response_micro_batches(groups, int(data["max_token_len_per_gpu"]))
    else:
        size = int(data["micro_batch_size_per_gpu"])
        order = [r for p in response_micro_batches(groups, None) for r in p]
        parts = [order[i : i + size] for i in range(0, len(order), size)]
    while k is not None and len(parts) < k:
        splittable = [i for i, p in enumerate(parts) if len(p) > 1]
        if not splittable:
            break
        i = max(splittable, key=lambda i: sum(groups.response_lens[r] for r in parts[i]))
        rows = parts.pop(i)
        half = len(rows) // 2
        parts[i:i] = [rows[:half], rows[half:]]
    return parts


def prompt_once_batch(engine, data, loss_function, forward_only: bool) -> dict | str | object:
    """verl's `forward_backward_batch` under the prompt-once schedule (module doc): the pass's output,
    or the reason it is handed back to the within-micro-batch path (the same on every rank), or
    AUTO_WITHIN where schedule="auto" chose that path."""
    group = _data_parallel(engine)
    reason = _local_reason(engine, data)
    groups = local = rows = None
    if reason is None:
        rows = rows_of(data)
        assert isinstance(rows, VerlRows)  # _local_reason returned rows_of's reason otherwise
        groups = Groups.of(rows.batch)
        local = schedule_parts(groups, data)
    # MAX of (cannot serve, micro-batches, -rows): every rank learns whether any rank cannot serve,
    # the count every rank runs, and whether some rank has fewer rows than that.
    cannot, k, neg_rows = _agree_max([int(reason is not None), len(local or ()), -len(data)], group)
    if cannot:
        return reason or OTHER_RANK
    if k > -neg_rows:
        return f"a data-parallel rank has fewer rows ({-neg_rows}) than the agreed micro-batch count ({k})"
    assert groups is not None and isinstance(rows, VerlRows)
    parts = schedule_parts(groups, data, k)
    if engine.zorro_config.schedule == "auto" and not _auto_takes_schedule(engine, data, rows, parts, group):
        return AUTO_WITHIN
    try:
        return _run(engine, data, loss_function, forward_only, rows, groups, parts, group)
    except UnsupportedModelError as e:
        # Raised in phase 1 (e.g. an attention module run twice), alike on every rank, before any
        # backward; kept, so that later passes go to the within-micro-batch path straight away.
        engine._zorro_schedule_refused = f"the prompt-once schedule refuses the model: {e}"
        return engine._zorro_schedule_refused


def _budget(data) -> Optional[int]:
    """verl's token budget (dynamic batch size), or None (a fixed micro-batch size)."""
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        return int(data["max_token_len_per_gpu"])
    return None


def _auto_takes_schedule(engine, data, rows: VerlRows, parts, group) -> bool:
    """schedule="auto" (zorro_core.actor.auto) on this rank's rows, agreed: the schedule only where every
    rank's choice is the schedule. The within path's micro-batches: the library's partition at verl's
    budget, or (a fixed micro-batch size) the same rows per micro-batch as the schedule's. The choice's
    figures go to the pass's metrics (engine._zorro_auto_metrics)."""
    from zorro_core.actor.auto import choose_schedule

    budget = _budget(data)
    within = None if budget is not None else parts
    choice = choose_schedule(engine._zorro_actor(), rows.batch, budget, within_parts=within, schedule_parts=parts)
    (not_all,) = _agree_max([int(choice.schedule != "prompt_once")], group)
    metrics = choice.metrics()
    metrics["zorro/auto_prompt_once"] = 0.0 if not_all else 1.0
    engine._zorro_auto_metrics = metrics
    return not not_all


def _run(engine, data, loss_function, forward_only, rows: VerlRows, groups: Groups, parts, group) -> dict:
    # verl's FSDPEngine.forward_backward_batch prologue: the loss's global constants.
    tu.assign_non_tensor(data, sp_size=engine.ulysses_sequence_parallel_size)
    return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
    batch_num_tokens = data["loss_mask"].sum().to(get_device_id())
    if group is not None:
        dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=group)
    tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
    tu.assign_non_tensor(data, dp_size=engine.get_data_parallel_size())

    actor = engine._zorro_actor()
    temperature = temperature_of(data)
    assert not isinstance(temperature, str)
    calculate_entropy = flag(data, "calculate_entropy")
    lp_dtype, ent_dtype = engine._verl_dtypes()
    dp_group = engine.get_data_parallel_group()
    scaler = getattr(engine, "scaler", None)
    outputs: list[dict] = []
    # The token budget (dynamic batch size): the micro-batches are `parts`; it bounds the waves'
    # prompt tokens and phase 1's calls (zorro_core.actor.waves). A fixed micro-batch size has none.
    budget = _budget(data)

    def model_output_of(idx: torch.Tensor, log_probs, entropy):
        mb = tu.index_select_tensor_dict(data, idx.cpu())
        mb_rows = rows_of(mb)
        assert isinstance(mb_rows, VerlRows)
        out = {"log_probs": mb_rows.to_nested(log_probs if lp_dtype is None else log_probs.to(lp_dtype))}
        if calculate_entropy:
            out["entropy"] = mb_rows.to_nested(entropy if ent_dtype is None else entropy.to(ent_dtype))
        return mb, out

    def record(mb, model_output, loss, metrics) -> None:
        meta = {
            "model_output": engine_utils.detach_tree(model_output),
            "loss": loss.detach().item(),
            "metrics": metrics,
        }
        if not forward_only and not return_model_output:
            meta.pop("model_output")  # verl's loop drops training outputs unless asked (they pin memory)
        outputs.append(meta)

    def loss_fn(out, idx):
        mb, model_output = model_output_of(idx, out.log_probs, out.entropy)
        loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=dp_group)
        record(mb, model_output, loss, metrics)
        return scaler.scale(loss) if scaler is not None else loss

    with engine._autocast():
        if forward_only:
            res = prompt_once_logprobs(actor, rows.batch, budget, temperature, calculate_entropy, parts)
            for part in res.parts:
                idx = torch.as_tensor(part, dtype=torch.long, device=res.log_probs.device)
                ent = res.entropy[idx] if res.entropy is not None else None
                mb, model_output = model_output_of(idx, res.log_probs[idx], ent)
                if loss_function is not None:
                    loss, metrics = loss_function(model_output=model_output, data=mb, dp_group=dp_group)
                else:
                    loss, metrics = torch.tensor(1.0, device=get_device_name()), {}
                record(mb, model_output, loss, metrics)
        else:
            res = _train(engine, actor, rows, loss_fn, temperature, calculate_entropy, parts, budget)

    output = engine_utils.postprocess_batch_func(output_lst=outputs, indices=res.parts, data=data)
    if not tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        order = torch.as_tensor([r for p in res.parts for r in p])  # verl's postprocess keeps part order
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        model_output = output.get("model_output", {})
        for key, value in list(model_output.items()):
            if isinstance(value, torch.Tensor) and value.shape[0] == order.numel():
                rows_ = value.unbind() if value.is_nested else None
                model_output[key] = (
                    torch.nested.as_nested_tensor([rows_[int(i)] for i in inverse], layout=torch.jagged)
                    if rows_ is not None
                    else value[inverse]
                )
    engine._zorro_schedule_record(_stats(data, rows, groups, res))
    return output


def _train(
    engine, actor, rows: VerlRows, loss_fn, temperature, calculate_entropy, parts, budget: Optional[int]
) -> ScheduleOutput:
    """prompt_once_step with FSDP2's gradient sync off through phase 2 and on for the last wave's phase 3."""
    defer = getattr(engine.engine_config, "use_no_sync_for_gradient_accumulation", True)
    module = engine.module
    if not (defer and fsdp_version(module) == 2):
        return prompt_once_step(actor, rows.batch, loss_fn, budget, temperature, calculate_entropy, parts)
    module.set_requires_gradient_sync(False)
    try:
        return prompt_once_step(
            actor,
            rows.batch,
            loss_fn,
            budget,
            temperature,
            calculate_entropy,
            parts,
            on_prompts_backward=lambda: module.set_requires_gradient_sync(True),
        )
    finally:
        module.set_requires_gradient_sync(True)


def _stats(data, rows: VerlRows, groups: Groups, res: ScheduleOutput) -> tuple[list[MicroBatchStats], ScheduleStats]:
    """The pass's per-micro-batch figures (phase 1's prompt tokens on the first, so the engine's
    usual totals hold) and the schedule's own."""
    plen = rows.prompt_lens.tolist()
    rlen = rows.response_lens.tolist()
    per_part = []
    micro_batch_prompt = 0
    for i, part in enumerate(res.parts):
        prompt = sum(plen[r] for r in part)
        unique = {groups.group_of_row[r] for r in part}
        micro_batch_prompt += sum(len(groups.prompts[g]) for g in unique)
        computed_prompt = res.prompt_tokens if i == 0 else 0
        per_part.append(
            MicroBatchStats(
                True,
                prompt,
                computed_prompt,
                prompt + sum(rlen[r] for r in part),
                computed_prompt + res.response_tokens[i],
            )
        )
    schedule = ScheduleStats(
        prompts=len(groups.prompts),
        rows=len(data),
        prompt_tokens=res.prompt_tokens,
        prompt_tokens_plain=sum(plen),
        prompt_tokens_micro_batch=micro_batch_prompt,
        split_groups=len(res.split_groups),
        kept_bytes=res.kept_bytes,
        waves=len(res.waves),
        oversize_waves=sum(w.oversize for w in res.waves),
        phase1_max_tokens=max(res.phase1_calls, default=0),
    )
    return per_part, schedule


def schedule_metrics(output: dict, schedule: Optional[ScheduleStats], configured: bool) -> dict:
    """The schedule's "zorro/..." figures added to a pass's metrics (one-element lists, as
    zorro_core.integrations.verl.metrics adds its own). `configured`: the engine's config asks for
    the schedule (then "zorro/prompt_once" says whether it ran, 1.0, or was handed back, 0.0)."""
    if not configured:
        return output
    metrics = output.setdefault("metrics", {})
    metrics["zorro/prompt_once"] = [1.0 if schedule is not None else 0.0]
    if schedule is None:
        return output
    figures = {
        "zorro/prompts_computed": schedule.prompts,
        "zorro/prompts_plain": schedule.rows,
        "zorro/prompt_tokens_computed": schedule.prompt_tokens,
        "zorro/prompt_tokens_plain": schedule.prompt_tokens_plain,
        "zorro/prompt_tokens_micro_batch": schedule.prompt_tokens_micro_batch,
        "zorro/split_groups": schedule.split_groups,
        "zorro/kept_bytes": schedule.kept_bytes,
        "zorro/waves": schedule.waves,
        "zorro/oversize_waves": schedule.oversize_waves,
        "zorro/phase1_max_tokens": schedule.phase1_max_tokens,
    }
    for key, value in figures.items():
        metrics[key] = [float(value)]
    return output
