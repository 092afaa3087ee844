"""`zorro bench memory --budget`: the prompt-once schedule's memory against the within-micro-batch path.

Counted as `zorro bench memory` counts (zorro_harness.bench.memory: every tensor autograd saves,
each storage once, parameters left out, on CPU through `flash_cpu`, a narrowed model scaled back).

At a micro-batch token budget, one step of each path:
- `micro_batch`: zorro today (zorro_core.actor.microbatch): the library's partition at the budget;
  micro-batches run one after another, so the peak is the largest one's forward (counted).
- `prompt_once` (zorro_core.actor.schedule): phase 1 runs the unique prompts once and keeps their
  graph, the kept keys and values (leaves) and, from the first response micro-batch's backward on,
  those leaves' gradients; phase 2 runs the response micro-batches (budget in response tokens)
  one at a time. Counted: phase 1's forward, and the largest response micro-batch's forward on
  top of it (the step runs for real through `prompt_once_step` and is stopped before that
  micro-batch's backward). The kept keys and values are the storages phase 2's attention saves
  as views of phase 1's leaves; their gradients are as large.

Peaks (bytes beside the weights, gradients and optimizer state):
- without checkpointing: micro_batch, its saved bytes; prompt_once, phase 1's saved bytes (and
  any kept storage they do not hold) + the leaves' gradients + the micro-batch's saved bytes.
- with gradient checkpointing of every decoder layer, derived as `zorro bench memory` derives it
  (a layer keeps its input; one layer's saved set is re-made at a time in backward): micro_batch,
  L x T x hidden + one layer + outside; prompt_once, the larger of phase 2 (the prompts' layer
  inputs and outside saves, the kept keys and values and their gradients, and the micro-batch's
  checkpointed peak) and phase 3 (the same residents and one layer of the prompts recomputed).
The kept first-token hidden states ([U, hidden] and their gradient) are left out: a few KB.

The longest prompt that fits is a search over P (bisection) on the same counts: every saved tensor
of these paths is per token (flash saves no [T, T] tensor), so at a fixed micro-batch layout each
count is affine in P; a layout's line is read off two counts, and the layout at each probed P is the
library's own (the partition, the response micro-batches).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.microbatch import micro_batch_partition
from zorro_core.actor.schedule import Groups, phase1_cuts, prompt_once_step, response_micro_batches
from zorro_core.actor.waves import plan_waves
from zorro_core.models.presets import build_model, preset_config
from zorro_core.models.registry import model_shape
from zorro_core.plan.balance import GroupedLengths, partition_micro_batches, select_rows
from zorro_core.plan.batch import RolloutBatch, create_dummy_batch
from zorro_core.plan.cost import flops, plan_workload
from zorro_core.plan.dtypes import DTYPES
from zorro_harness.bench.isolation import run_isolated
from zorro_harness.bench.memory import _layer_of, narrowed_config

SCHEDULE_PATHS = ("micro_batch", "prompt_once", "waves")
"""zorro today; the schedule with every prompt of the step in one phase 1 (one call, one wave: as it
ran before waves, and as an explicit `parts` without a wave bound runs it); the schedule as it runs
at the budget (zorro_core.actor.waves: waves of at most `budget` prompt tokens, phase 1 in calls of
at most `budget` tokens)."""
BACKEND = "flash_cpu"
"""The kernel pair both paths run on CPU (it saves what flash-attn 2 saves: q, k, v, out, lse)."""


@dataclass(frozen=True)
class ScheduleCase:
    """One count: a model shape, a batch shape, the budget."""

    model: str
    """A preset name (its shape, random weights)."""
    batch: int
    """B, rows."""
    prompt_len: int
    """P, tokens of every prompt."""
    response_len: int
    """R, tokens of every response."""
    unique: int
    """U, distinct prompts (B / U responses each)."""
    budget: int
    """The micro-batch token budget (tokens computed; prompt_once counts response tokens)."""
    logits_mode: str = "compute"
    """The actor's logits_mode ("compute" or "memory")."""
    dtype: str = "bfloat16"
    """Model dtype."""
    layers: int = 1
    """Decoder layers built and counted (scaled to the preset's)."""
    narrow: int = 8
    """Widths divided by this (head dims kept), counts multiplied back."""


@dataclass
class PathCount:
    """What one path keeps, scaled to the full model (bytes)."""

    case: ScheduleCase
    path: str
    micro_batches: int
    """Micro-batches of the step (prompt_once: response micro-batches)."""
    step_tokens: int
    """Tokens the step computes (prompt_once: phase 1 + every response micro-batch)."""
    largest_rows: int
    """Rows of the largest micro-batch (its layout, with `largest_prompts`)."""
    largest_prompts: int
    """Distinct prompts the largest micro-batch computes (0 for prompt_once: it computes none)."""
    largest_tokens: int
    """Tokens the largest micro-batch computes."""
    prompt_tokens: int
    """prompt_once: phase 1's tokens (0 for micro_batch)."""
    prompt_layer: float
    """prompt_once: bytes one decoder layer saves in phase 1."""
    prompt_outside: float
    """prompt_once: bytes phase 1 saves outside the decoder layers."""
    kept: float
    """prompt_once: bytes of the kept keys and values (every layer)."""
    kept_unsaved: float
    """prompt_once: the part of `kept` that phase 1's saved tensors do not hold."""
    layer: float
    """Bytes one decoder layer saves in the largest micro-batch."""
    outside: float
    """Bytes the largest micro-batch saves outside the decoder layers."""
    full_layers: int
    hidden_bytes: int
    """Bytes of one token's hidden state (the full model's width)."""
    flops: float
    """The cost model's forward+backward FLOPs of the step (zorro_core.plan.cost, the full model)."""
    waves: int = 0
    """waves: the step's waves (the counted one is the first, the largest); 1 for prompt_once."""
    chunk_tokens: int = 0
    """waves / prompt_once: tokens of the largest phase-1 call (the prompt re-made one layer at a
    time of one call in phase 3 under checkpointing)."""

    @property
    def saved(self) -> float:
        """Bytes autograd holds at the peak without checkpointing (prompt_once: phase 1 + the micro-batch)."""
        n = self.full_layers
        return n * self.prompt_layer + self.prompt_outside + self.kept_unsaved + n * self.layer + self.outside

    @property
    def kept_grad(self) -> float:
        """The kept leaves' gradients (as large as the leaves)."""
        return self.kept

    @property
    def peak(self) -> float:
        return self.saved + self.kept_grad

    @property
    def peak_checkpointed(self) -> float:
        n, hb = self.full_layers, self.hidden_bytes
        micro = n * self.largest_tokens * hb + self.layer + self.outside
        if self.path == "micro_batch":
            return micro
        resident = n * self.prompt_tokens * hb + self.prompt_outside + self.kept + self.kept_grad
        chunk = self.prompt_layer * (self.chunk_tokens / self.prompt_tokens if self.prompt_tokens else 1.0)
        return max(resident + micro, resident + chunk)

    @property
    def host(self) -> float:
        """waves with offload on (zorro_core.actor.offload): phase 1's saved bytes moved to the host
        without checkpointing (every layer's and outside's). Under checkpointing only the outside
        saves move: non-reentrant checkpoint keeps the layer inputs itself, not as saved tensors."""
        return self.full_layers * self.prompt_layer + self.prompt_outside if self.path == "waves" else 0.0

    @property
    def host_checkpointed(self) -> float:
        return self.prompt_outside if self.path == "waves" else 0.0

    def as_built(self) -> "PathCount":
        """The count of the model as built (its `layers`, its narrowed widths), not scaled to the
        preset's: what a device running that same small model holds."""
        f = self.case.layers / (self.case.narrow * self.full_layers)
        return dataclasses.replace(
            self,
            prompt_layer=self.prompt_layer / self.case.narrow,
            prompt_outside=self.prompt_outside / self.case.narrow,
            kept=self.kept * f,
            kept_unsaved=self.kept_unsaved * f,
            layer=self.layer / self.case.narrow,
            outside=self.outside / self.case.narrow,
            full_layers=self.case.layers,
            hidden_bytes=self.hidden_bytes // self.case.narrow,
        )

    def as_dict(self) -> dict:
        return {
            **dataclasses.asdict(self.case),
            "path": self.path,
            "micro_batches": self.micro_batches,
            "step_tokens": self.step_tokens,
            "largest_tokens": self.largest_tokens,
            "prompt_tokens": self.prompt_tokens,
            "saved_bytes": round(self.saved),
            "kept_bytes": round(self.kept),
            "kept_grad_bytes": round(self.kept_grad),
            "peak_bytes": round(self.peak),
            "peak_checkpointed_bytes": round(self.peak_checkpointed),
            "flops_fwd_bwd": self.flops,
            "waves": self.waves,
            "phase1_call_tokens": self.chunk_tokens,
            # waves with offload on: what moves to the host, and the device peak left (docs/schedule.md)
            "offload_host_bytes": round(self.host),
            "offload_peak_bytes": round(self.peak - self.host),
            "offload_host_checkpointed_bytes": round(self.host_checkpointed),
            "offload_peak_checkpointed_bytes": round(self.peak_checkpointed - self.host_checkpointed),
        }


class _Stop(Exception):
    """Raised by the counting loss after the micro-batch it counts: no backward runs."""


class _PhaseCounter:
    """Saved bytes by (phase, decoder layer), each storage once across phases; the kept leaves'
    storages (saved in phase 2 as views of phase 1's leaves) found by their base."""

    def __init__(self, model, params: set[int]) -> None:
        self.params = params
        self.phase = -1
        self.first_seen: dict[int, int] = {}
        n = len(model.model.layers)
        self.layer_bytes: dict[int, list[int]] = {}
        self.outside: dict[int, int] = {}
        self.kept: dict[int, int] = {}
        """Kept storage pointer -> its bytes."""
        self.kept_in_phase1: dict[int, bool] = {}
        self.n = n
        self.layer_now, self.remove = _layer_of(model.model.layers)

    def next_phase(self, *_: Any) -> None:
        self.phase += 1
        self.layer_bytes[self.phase] = [0] * self.n
        self.outside[self.phase] = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t._base
        if (
            base is not None
            and base.is_leaf
            and base.requires_grad
            and base.untyped_storage().data_ptr() not in self.params
        ):
            s = base.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in self.kept:
                self.kept[ptr] = s.nbytes()
                self.kept_in_phase1[ptr] = self.first_seen.get(ptr) == 0
            return t
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in self.params or ptr in self.first_seen or not s.nbytes() or self.phase < 0:
            return t
        self.first_seen[ptr] = self.phase
        i = self.layer_now()
        if i is None:
            self.outside[self.phase] += s.nbytes()
        else:
            self.layer_bytes[self.phase][i] += s.nbytes()
        return t


def _model(case: ScheduleCase, seed: int):
    cfg, full_layers = narrowed_config(case.model, case.layers, case.narrow)
    model = build_model(cfg, dtype=DTYPES[case.dtype], seed=seed, attn_implementation="sdpa")
    return model.train(), cfg, full_layers


def _batch(case: ScheduleCase, vocab: int, seed: int) -> RolloutBatch:
    if case.batch % case.unique:
        raise ValueError(f"--batch {case.batch} must be a multiple of --unique {case.unique}")
    return create_dummy_batch(
        batch_size=case.batch,
        num_unique_prompts=case.unique,
        prompt_len=case.prompt_len,
        response_len=case.response_len,
        vocab_size=vocab,
        seed=seed,
    )


def _step_flops(actor, batch: RolloutBatch, parts: list[list[int]], shape, mode: str) -> float:
    return sum(flops(shape, plan_workload(actor.plan(select_rows(batch, p)), mode)).forward_backward for p in parts)


def count_schedule_case(case: ScheduleCase, seed: int = 0, paths: tuple[str, ...] = SCHEDULE_PATHS) -> list[PathCount]:
    """The `paths` of `case` (module doc), counted on CPU."""
    model, cfg, full_layers = _model(case, seed)
    batch = _batch(case, cfg.vocab_size, seed)
    config = ActorConfig(varlen_backend=BACKEND, logits_mode=case.logits_mode)
    actor = DeduplicatedActor(model=model, config=config)
    shape = model_shape(preset_config(case.model))
    scale = case.narrow
    hidden_bytes = cfg.hidden_size * scale * DTYPES[case.dtype].itemsize
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    built = len(model.model.layers)
    out: list[PathCount] = []

    if "micro_batch" in paths:
        out.append(_count_micro_batch(case, actor, batch, params, built, full_layers, hidden_bytes, shape))
    if "prompt_once" in paths:
        out.append(_count_prompt_once(case, actor, batch, params, built, full_layers, hidden_bytes, shape))
    if "waves" in paths:
        out.append(_count_waves(case, actor, batch, params, built, full_layers, hidden_bytes, shape))
    return out


def _count_micro_batch(case, actor, batch, params, built, full_layers, hidden_bytes, shape) -> PathCount:
    """zorro today: the library's partition at the budget; its largest micro-batch counted."""
    model, scale = actor.model, case.narrow
    part = micro_batch_partition(actor, batch, case.budget)
    big = max(range(len(part.parts)), key=lambda i: part.tokens[i])
    rows = part.parts[big]
    sub = select_rows(batch, rows)
    counter = _PhaseCounter(model, params)
    counter.next_phase()
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            res = actor.forward(sub)
            tokens = res.plan.num_tokens
            del res
    finally:
        counter.remove()
    return PathCount(
        case, "micro_batch", len(part.parts), sum(part.tokens), len(rows), len(Groups.of(sub).prompts), tokens,
        0, 0.0, 0.0, 0.0, 0.0,
        scale * sum(counter.layer_bytes[0]) / built, scale * counter.outside[0], full_layers, hidden_bytes,
        _step_flops(actor, batch, part.parts, shape, case.logits_mode),
    )  # fmt: skip


def _count_prompt_once(case, actor, batch, params, built, full_layers, hidden_bytes, shape) -> PathCount:
    """The step for real as one wave (explicit parts, no bound), its largest response micro-batch
    first, stopped before that one's backward."""
    groups = Groups.of(batch)
    parts = response_micro_batches(groups, case.budget)
    sizes = [sum(groups.response_lens[r] for r in p) for p in parts]
    big = max(range(len(parts)), key=lambda i: sizes[i])
    ordered = [parts[big], *parts[:big], *parts[big + 1 :]]
    prompt_tokens = sum(len(p) for p in groups.prompts)

    def step(loss):
        prompt_once_step(actor, batch, loss, parts=ordered)

    counted = _count_step(actor, batch, params, built, step, 1)
    return _schedule_count(
        case, "prompt_once", counted, len(parts), prompt_tokens + sum(sizes), len(parts[big]), prompt_tokens,
        full_layers, hidden_bytes,
        _step_flops(actor, batch, [list(range(batch.batch_size))], shape, case.logits_mode), 1, prompt_tokens,
    )  # fmt: skip


def _count_waves(case, actor, batch, params, built, full_layers, hidden_bytes, shape) -> PathCount:
    """The step for real at the budget (waves, phase 1 in calls under the budget), stopped before the
    first response micro-batch's backward: the first wave (the largest: the case's groups are alike)
    and its first micro-batch (its largest: cut greedily)."""
    groups = Groups.of(batch)
    plans = _wave_plans(groups, case.budget)
    first = plans[0]
    cuts = phase1_cuts(first.prompt_tokens, case.budget)
    sizes = [sum(groups.response_lens[r] for r in p) for plan in plans for p in plan.parts]

    def step(loss):
        prompt_once_step(actor, batch, loss, case.budget)

    counted = _count_step(actor, batch, params, built, step, len(cuts))
    if counted[-1] != sum(groups.response_lens[r] for r in first.parts[0]):
        raise RuntimeError("the counted micro-batch is not the first wave's first")
    return _schedule_count(
        case, "waves", counted, len(sizes), sum(p.prompt_tokens for p in plans) + sum(sizes), len(first.parts[0]),
        first.prompt_tokens, full_layers, hidden_bytes,
        sum(_step_flops(actor, batch, [p.rows], shape, case.logits_mode) for p in plans), len(plans),
        max(b - a for a, b in cuts),
    )  # fmt: skip


def _wave_plans(groups: Groups, budget: int):
    """The schedule's waves at the budget, as prompt_once_step plans them (rows in group order)."""
    order = sorted(range(len(groups.group_of_row)), key=lambda r: (groups.group_of_row[r], r))
    return plan_waves(groups.prompts, groups.group_of_row, groups.response_lens, order, budget, budget)


def _count_step(actor, batch, params, built, step, phase1_calls: int):
    """Run `step(loss)` under the counter until its first loss: (layer bytes of phase 1, outside bytes of
    phase 1, kept bytes, kept bytes phase 1 did not save, layer bytes of the micro-batch, outside
    bytes of the micro-batch, the micro-batch's response tokens), unscaled."""
    model = actor.model
    counter = _PhaseCounter(model, params)
    hook = actor.parts.base.register_forward_pre_hook(counter.next_phase)
    micro_tokens = []

    def stop(res, rows):
        micro_tokens.append(int(batch.response_mask[rows].sum()))
        raise _Stop

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            try:
                step(stop)
            except _Stop:
                pass
            else:
                raise RuntimeError("the prompt-once step never called its loss")
    finally:
        hook.remove()
        counter.remove()
        model.zero_grad(set_to_none=True)
    if counter.phase != phase1_calls:
        raise RuntimeError(
            f"the prompt-once step ran {counter.phase + 1} forwards before its first loss, not {phase1_calls + 1}"
        )
    if not counter.kept:
        raise RuntimeError(
            "no kept keys or values were seen in phase 2: the schedule's attention did not run through the kernel pair"
        )
    p1 = range(phase1_calls)
    kept = sum(counter.kept.values())
    unsaved = sum(b for p, b in counter.kept.items() if not counter.kept_in_phase1[p])
    return (
        sum(sum(counter.layer_bytes[i]) for i in p1), sum(counter.outside[i] for i in p1), kept, unsaved,
        sum(counter.layer_bytes[phase1_calls]), counter.outside[phase1_calls], micro_tokens[0],
    )  # fmt: skip


def _schedule_count(
    case, path, counted, micro_batches, step_tokens, largest_rows, prompt_tokens, full_layers, hidden_bytes, flops,
    waves, chunk_tokens,
) -> PathCount:  # fmt: skip
    p_layer, p_out, kept, unsaved, layer, outside, micro = counted
    scale, built = case.narrow, case.layers
    return PathCount(
        case, path, micro_batches, step_tokens, largest_rows, 0, micro, prompt_tokens,
        scale * p_layer / built, scale * p_out, scale * kept / built * full_layers, scale * unsaved / built * full_layers,
        scale * layer / built, scale * outside, full_layers, hidden_bytes, flops, waves, chunk_tokens,
    )  # fmt: skip


def _count_child(case: ScheduleCase, paths: tuple[str, ...], conn) -> None:
    try:
        conn.send({"rows": count_schedule_case(case, paths=paths)})
    except Exception as e:  # noqa: BLE001 - any failure is the case's status, said in the parent
        conn.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def count_schedule_isolated(
    case: ScheduleCase, paths: tuple[str, ...] = SCHEDULE_PATHS, timeout_s: float = 3600.0
) -> list[PathCount]:
    """count_schedule_case in its own process (as memory.count_isolated)."""
    result = run_isolated(_count_child, (case, paths), timeout_s)
    if result.status != "ok":
        raise ValueError(f"{case.model} P={case.prompt_len} budget {case.budget}: {result.status}: {result.error}")
    return result.payload["rows"]


def _layout(count: PathCount) -> tuple[int, int, int, int, int]:
    calls = -(-count.prompt_tokens // count.chunk_tokens) if count.chunk_tokens else 0  # phase 1's calls
    return count.micro_batches, count.largest_rows, count.largest_prompts, count.waves, calls


def at_prompt_len(a: PathCount, b: PathCount, prompt_len: int) -> PathCount:
    """The count at `prompt_len` on the line through two counts of one layout (every field affine in P)."""
    if _layout(a) != _layout(b) or a.path != b.path:
        raise ValueError(f"the two counts have different micro-batch layouts ({_layout(a)} vs {_layout(b)})")
    p0, p1 = a.case.prompt_len, b.case.prompt_len
    if p0 == p1:
        raise ValueError("two counts at one prompt length define no line")
    f = (prompt_len - p0) / (p1 - p0)
    lin = lambda x, y: x + f * (y - x)  # noqa: E731
    fields = ("prompt_layer", "prompt_outside", "kept", "kept_unsaved", "layer", "outside", "flops")
    ints = ("step_tokens", "largest_tokens", "prompt_tokens", "chunk_tokens")
    return dataclasses.replace(
        a,
        case=dataclasses.replace(a.case, prompt_len=prompt_len),
        **{k: lin(getattr(a, k), getattr(b, k)) for k in fields},
        **{k: round(lin(getattr(a, k), getattr(b, k))) for k in ints},
    )


def layout_at(case: ScheduleCase, path: str) -> tuple[int, ...]:
    """The micro-batch layout the library gives `path` at `case`, from lengths alone (the dummy
    batch's: row i holds prompt i mod U; nothing is built). waves: also the first wave's groups and
    phase-1 calls."""
    owner = [i % case.unique for i in range(case.batch)]
    rlens = [case.response_len] * case.batch
    if path == "waves":
        groups = Groups([[g] * case.prompt_len for g in range(case.unique)], owner, rlens)
        plans = _wave_plans(groups, case.budget)
        first = plans[0]
        calls = len(phase1_cuts(first.prompt_tokens, case.budget))
        wave_groups = len({owner[r] for r in first.rows})
        return sum(len(p.parts) for p in plans), len(first.parts[0]), wave_groups, calls
    if path == "prompt_once":
        parts = response_micro_batches(Groups([[0]] * case.unique, owner, rlens), case.budget)
        return len(parts), max(len(p) for p in parts), 0
    work = GroupedLengths(owner, [case.prompt_len] * case.unique, rlens)
    part = partition_micro_batches(work, case.budget)
    big = max(range(len(part.parts)), key=lambda i: part.tokens[i])
    rows = part.parts[big]
    return len(part.parts), len(rows), len({owner[r] for r in rows})


LONGEST_PROMPT_CEILING = 1 << 22
"""The longest prompt the search tries: a result equal to it means "this long or longer"."""


def longest_prompt_search(
    case: ScheduleCase,
    path: str,
    budget_bytes: float,
    checkpointed: bool,
    count: Callable[..., dict[str, PathCount]],
    hi: int = LONGEST_PROMPT_CEILING,
) -> int:
    """The longest P in [1, hi] whose peak fits `budget_bytes` on `path` (0: not even P = 1; hi: hi or more), by
    bisection over P. Each probe's count is the line through two counts of the layout the library
    gives that P (counted at the layout's lowest P and one response length above it, within the
    layout; a layout of one P is counted there); `count(case, paths)` is `memoised`'s."""
    lines: dict[tuple, tuple[PathCount, ...]] = {}

    def at(p: int) -> ScheduleCase:
        return dataclasses.replace(case, prompt_len=p)

    def peak(p: int) -> float:
        lay = layout_at(at(p), path)
        if lay not in lines:
            start, end = _layout_span(case, path, lay, p, hi)
            ends = (start, min(start + max(case.response_len, 64), end)) if end > start else (start,)
            lines[lay] = tuple(count(at(q), (path,))[path] for q in ends)
        counted = lines[lay]
        c = counted[0] if len(counted) == 1 else at_prompt_len(counted[0], counted[1], p)
        return c.peak_checkpointed if checkpointed else c.peak

    if peak(1) > budget_bytes:
        return 0
    lo, top = 1, hi
    if peak(top) <= budget_bytes:
        return top
    while top - lo > 1:
        mid = (lo + top) // 2
        if peak(mid) <= budget_bytes:
            lo = mid
        else:
            top = mid
    return lo


def _layout_span(case: ScheduleCase, path: str, lay: tuple, p: int, hi: int) -> tuple[int, int]:
    """The P range [start, end] around p (within [1, hi]) with layout `lay` on `path` (a layout
    changes only where a prompt plus some responses cross the budget, so its P form one range)."""

    def same(q: int) -> bool:
        return layout_at(dataclasses.replace(case, prompt_len=q), path) == lay

    lo, top = 1, p  # the lowest P of the layout: same(top) holds
    if same(lo):
        top = lo
    while top - lo > 1:
        mid = (lo + top) // 2
        lo, top = (lo, mid) if same(mid) else (mid, top)
    start = top
    lo, top = p, hi  # the highest: same(lo) holds
    if same(top):
        lo = top
    while top - lo > 1:
        mid = (lo + top) // 2
        lo, top = (mid, top) if same(mid) else (lo, mid)
    return start, lo


def memoised(count: Callable[..., list[PathCount]]) -> Callable[..., dict[str, PathCount]]:
    """`count(case, paths=...)` memoised by (case, path): get(case, paths) -> {path: its count}."""
    done: dict[tuple[ScheduleCase, str], PathCount] = {}

    def get(case: ScheduleCase, paths: tuple[str, ...] = SCHEDULE_PATHS) -> dict[str, PathCount]:
        todo = tuple(p for p in paths if (case, p) not in done)
        if todo:
            for c in count(case, paths=todo):
                done[case, c.path] = c
        return {p: done[case, p] for p in paths}

    return get


def ideal_speedup(counts: dict[str, PathCount]) -> Optional[float]:
    """The cost model's FLOPs of micro_batch over prompt_once (each prompt once per step)."""
    mb, po = counts.get("micro_batch"), counts.get("prompt_once")
    return mb.flops / po.flops if mb and po and po.flops else None
