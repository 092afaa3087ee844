"""Waves: the prompt-once schedule's step in parts whose kept state fits a bound.

The schedule (zorro_core.actor.schedule) keeps what phase 1 computes for a prompt (its kept keys and
values, their gradients, its graph or, under gradient checkpointing, its layer inputs) until phase 3.
Run over a whole step at once, that is every prompt of the step, however many: a trainer's step
(a verl rank's mini-batch, a TRL accumulation window) holds many. So the step's groups are taken in
waves instead, and phases 1-3 run per wave:
- a wave's phase 1 holds at most `wave_tokens` tokens of prompts (its distinct prefixes under
  sharing="prefix"). The kept state is linear in those tokens at a fixed model (per token: each
  attention layer's keys and values and their gradients, the layer input under checkpointing), so a
  bound in tokens is a bound in bytes; by default it is the step's token budget, so that phase 1's
  kept state is at most what one budget's worth of prompt tokens keeps;
- a group (or, with explicit micro-batches, the groups their micro-batches tie together) whose
  prompt alone is over the bound is a wave of its own, and the step says so (`WaveStats.oversize`,
  a `WaveWarning`);
- each prompt is computed once per step: a group is never cut across waves (under sharing="prefix"
  a prefix shared by prompts of two waves is computed in each: `prompt_tokens` counts it twice);
- gradients accumulate across waves in `.grad`, as across micro-batches.

Under FSDP (sharded parameters) every rank must issue the same collectives: each forward gathers
each module's parameters, each backward gathers them again and (with sync on) reduce-scatters. A
rank whose budget gives it fewer waves, phase-1 chunks or micro-batches than another would wait in a
collective the other never issues. `agree_plan` makes the ranks agree first (one all-gather of each
rank's plan): every rank runs the most waves, chunks and micro-batches any rank has, padding with
zero-loss micro-batches and one-row zero-loss waves that join the same collectives and add exact
zeros; where a rank cannot reach the agreed count (a prompt shorter than the chunks asked of it,
chunked gated DeltaNet) every rank raises the same error at once, naming the cause.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist


class WaveWarning(UserWarning):
    """A group's kept state alone exceeds the wave bound: it ran as a wave of its own."""


@dataclass(frozen=True)
class WavePlan:
    """One wave: its rows and micro-batches, in the full batch's row indices."""

    rows: list[int]
    """Its rows, in the order its micro-batches take them."""
    parts: list[list[int]]
    """Its response micro-batches (rows of the full batch)."""
    prompt_tokens: int
    """Tokens its phase 1 computes (each prompt once, a prefix trie's distinct prefixes)."""
    oversize: bool
    """Its kept state alone exceeds the bound (one group, or one tied set of groups, over it)."""


@dataclass(frozen=True)
class WaveStats:
    """What one wave ran (ScheduleOutput.waves)."""

    prompt_tokens: int
    """Tokens of its phase 1."""
    phase1_calls: list[int]
    """Tokens of each of its phase-1 calls (chunks under the budget)."""
    micro_batches: int
    """Its response micro-batches (padding ones not counted)."""
    kept_bytes: int
    """Bytes of its kept keys, values, first-token hidden states and router logits (their gradients
    as many again from the first backward to phase 3)."""
    oversize: bool
    """Its kept state alone exceeds the wave bound."""
    host_bytes: int = 0
    """Bytes of its phase-1 graph held on the host (zorro_core.actor.offload); 0: offload off."""


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Tokens:
    """Phase-1 tokens of a growing set of prompts: their sum, or (prefix trie) their distinct
    prefixes, a prompt adding its length less its longest common prefix with any earlier one."""

    def __init__(self, trie: bool) -> None:
        self.trie, self.total = trie, 0
        self.prompts: list[Sequence[int]] = []

    def adding(self, prompts: Sequence[Sequence[int]]) -> int:
        total, seen = self.total, list(self.prompts)
        for p in prompts:
            total += len(p) - (max((_lcp(p, q) for q in seen), default=0) if self.trie else 0)
            seen.append(p)
        return total

    def add(self, prompts: Sequence[Sequence[int]]) -> None:
        self.total = self.adding(prompts)
        self.prompts.extend(prompts)


def _units(
    group_of_row: Sequence[int], order: Sequence[int], parts: Optional[Sequence[Sequence[int]]]
) -> list[tuple[list[int], list[list[int]]]]:
    """What a wave cannot cut: (groups, micro-batches). Without explicit parts, each group (its rows
    in `order`, micro-batches cut later); with them, the groups their micro-batches tie together
    (connected by a shared group), in the order of their first micro-batch."""
    if parts is None:
        rows_of: dict[int, list[int]] = {}
        for r in order:
            rows_of.setdefault(group_of_row[r], []).append(r)
        return [([g], [rows]) for g, rows in rows_of.items()]
    parent = list(range(len(parts)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, part in enumerate(parts):
        for r in part:
            g = group_of_row[r]
            if g in owner:
                parent[find(i)] = find(owner[g])
            else:
                owner[g] = i
    units: dict[int, tuple[list[int], list[list[int]]]] = {}
    for i, part in enumerate(parts):
        gs, ps = units.setdefault(find(i), ([], []))
        ps.append(list(part))
        for r in part:
            if group_of_row[r] not in gs:
                gs.append(group_of_row[r])
    return list(units.values())


def plan_waves(
    prompts: Sequence[Sequence[int]],
    group_of_row: Sequence[int],
    response_lens: Sequence[int],
    order: Sequence[int],
    max_tokens: Optional[int],
    wave_tokens: Optional[int],
    parts: Optional[Sequence[Sequence[int]]] = None,
    trie: bool = False,
) -> list[WavePlan]:
    """The step's waves (module doc). `order`: the rows in the order micro-batches take them (group
    order, a trie's depth-first order); `max_tokens`: the response budget cutting micro-batches
    (ignored with explicit `parts`); `wave_tokens`: the bound on a wave's phase-1 tokens (None: one wave)."""
    if wave_tokens is not None and (
        isinstance(wave_tokens, bool) or not isinstance(wave_tokens, int) or wave_tokens < 1
    ):
        raise ValueError(f"wave_tokens must be an int >= 1 or None, got {wave_tokens!r}")
    waves: list[tuple[_Tokens, list[list[int]], bool]] = []
    for groups, unit_parts in _units(group_of_row, order, parts):
        ps = [prompts[g] for g in groups]
        if waves and (wave_tokens is None or waves[-1][0].adding(ps) <= wave_tokens):
            waves[-1][0].add(ps)
            waves[-1][1].extend(unit_parts)
            continue
        tokens = _Tokens(trie)
        tokens.add(ps)
        waves.append((tokens, list(unit_parts), wave_tokens is not None and tokens.total > wave_tokens))
    plans = []
    for tokens, unit_parts, oversize in waves:
        if parts is None:  # the wave's rows, cut by the budget in response tokens
            rows = [r for p in unit_parts for r in p]
            unit_parts = cut_by_response_tokens(rows, response_lens, max_tokens)
        plans.append(WavePlan([r for p in unit_parts for r in p], unit_parts, tokens.total, oversize))
    return plans


def cut_by_response_tokens(
    rows: Sequence[int], response_lens: Sequence[int], max_tokens: Optional[int]
) -> list[list[int]]:
    """`rows` in their order, cut greedily when the next would pass `max_tokens` response tokens (a
    row longer than the budget alone is a micro-batch). None: one micro-batch."""
    if max_tokens is None:
        return [list(rows)]
    parts: list[list[int]] = [[]]
    used = 0
    for r in rows:
        n = response_lens[r]
        if parts[-1] and used + n > max_tokens:
            parts.append([])
            used = 0
        parts[-1].append(r)
        used += n
    return parts


def warn_oversize(plans: Sequence[WavePlan], wave_tokens: Optional[int]) -> None:
    over = [p.prompt_tokens for p in plans if p.oversize]
    if over:
        warnings.warn(
            "zorro: the prompt-once schedule ran a group whose kept state alone exceeds the wave bound as a "
            f"wave of its own ({len(over)} wave(s), up to {max(over)} prompt tokens against a bound of "
            f"{wave_tokens}); its kept keys and values are held whole until its phase 3",
            WaveWarning,
            stacklevel=4,
        )


@dataclass(frozen=True)
class Agreed:
    """What every rank runs (agree_plan): per wave index, the phase-1 chunks and micro-batches."""

    chunks: list[int]
    """Phase-1 calls of wave i on every rank."""
    micro_batches: list[int]
    """Response micro-batches of wave i on every rank (the fewer padded with zero-loss ones)."""


def agree_plan(
    own: Sequence[tuple[int, int, int]], dummy_tokens: int, linear: bool, device: torch.device
) -> Optional[Agreed]:
    """The plan every FSDP rank runs, from each rank's `own` waves (phase-1 chunks, micro-batches,
    phase-1 tokens) and the phase-1 tokens of the one-row wave it would pad with (`dummy_tokens`).
    None outside torch.distributed (or one rank). Raises the same ValueError on every rank, at
    once, where a rank cannot run the agreed counts."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    n = torch.tensor([len(own)], dtype=torch.long, device=on)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    w = int(n)
    mine = torch.zeros(w + 1, 3, dtype=torch.long, device=on)
    for i, wave in enumerate(own):
        mine[i] = torch.tensor(wave, dtype=torch.long)
    mine[w] = torch.tensor([len(own), dummy_tokens, int(linear)], dtype=torch.long)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu()  # [ranks, W + 1, 3]
    chunks = table[:, :w, 0].max(0).values.tolist()
    micro = table[:, :w, 1].max(0).values.tolist()
    problems = []
    for rank, t in enumerate(table):
        waves, dummy, lin = t[w].tolist()
        for i in range(w):
            tokens = int(t[i, 2]) if i < waves else dummy
            need = chunks[i]
            if need > 1 and lin:
                problems.append(f"rank {rank} wave {i}: {need} phase-1 chunks on gated DeltaNet layers")
            elif need > tokens:
                problems.append(f"rank {rank} wave {i}: {need} phase-1 chunks of a {tokens}-token phase 1")
    if problems:
        raise ValueError(
            "the prompt-once schedule under FSDP: the ranks' waves cannot be made to issue the same "
            f"collectives ({'; '.join(problems[:4])}); give the ranks the same budget-cut prompts or a larger "
            "max_tokens_per_micro_batch"
        )
    return Agreed(chunks, micro)
