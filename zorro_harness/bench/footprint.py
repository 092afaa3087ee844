"""Memory a benchmark case needs, from its shapes alone, and the guard that refuses a case that
cannot fit before anything is allocated.

The estimate is a lower bound: only tensors that must exist at once are counted, each at its
smallest size, so a refusal is never a false alarm (a case under the bound can still run out
of memory: the case process's watchdog, runner.run_isolated, turns that into a status=oom
row). Per case, in bytes:

- weights: embedding + lm_head (once if tied) + every layer's projections and MLP, all
  experts of a MoE layer (cost.ModelShape), at the model dtype; gradients as much again when a phase has a backward;
- batch: four [B, P] / [B, R] tensors (ids and masks, int64 and at least a byte);
- plan: two int64 per packed token of the arm (input ids and positions): B x (P + R) for the
  baseline, U x P + B x R for dedup;
- activations: forward under no_grad keeps one layer's MLP in flight (hidden + 2 x
  intermediate per token; a MoE layer: its shared experts'); forward+backward saves at least
  that much for every layer, and each token's top-k experts in a MoE layer (activation_widths);
- logits: float32 logits of the positions that get them (every packed position with
  logits_mode "none", the response tokens otherwise; "memory" mode: one chunk, its budget).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from zorro_core.models.registry import model_shape
from zorro_core.plan.cost import ModelShape
from zorro_harness.bench.suite import Case

_MEMORY_MODE_DEFAULT_MIB = 256  # the actor's default chunk budget in logits_mode "memory"
GIB = 2**30


@dataclass(frozen=True)
class Footprint:
    """Lower bound of what a case holds at its peak, in bytes, by part."""

    weights: int
    """Parameters, plus their gradients when a phase runs backward."""
    batch: int
    """The rollout batch's tensors."""
    plan: int
    """The packed row of the larger (baseline) arm."""
    activations: int
    """What the layers keep in flight (all layers when a backward follows)."""
    logits: int
    """float32 logits of the positions that get them (one chunk in memory mode)."""

    @property
    def total(self) -> int:
        return self.weights + self.batch + self.plan + self.activations + self.logits

    def describe(self) -> str:
        parts = ", ".join(
            f"{name} {gib(getattr(self, name))}" for name in ("weights", "batch", "plan", "activations", "logits")
        )
        return f"{gib(self.total)} ({parts})"


def gib(n: int) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB / 10 else f"{n / 2**20:.3g} MiB"


def parameter_count(shape: ModelShape, tied: bool) -> int:
    """Embedding, lm_head (unless tied to the embedding) and every layer's linear weights (all
    experts of a MoE layer)."""
    embed = shape.vocab_size * shape.hidden_size
    return embed * (1 if tied else 2) + shape.linear_params()


def activation_widths(shape: ModelShape) -> tuple[int, int]:
    """Per token: (what one layer's MLP surely holds at once, what all layers save for backward).

    A dense layer: hidden + 2 x intermediate (gate and up). A MoE layer: hidden + 2 x the shared
    experts' width at once (the routed experts may run a few tokens at a time); for backward,
    each token's top-k routed experts' gate and up are saved as well."""
    h, dense, moe = shape.hidden_size, shape.num_layers - shape.moe_layers, shape.moe_layers
    dense_w = h + 2 * shape.intermediate_size
    moe_w = h + 2 * shape.shared_intermediate_size
    in_flight = min(w for w, n in ((dense_w, dense), (moe_w, moe)) if n)
    saved = dense * dense_w + moe * (moe_w + 2 * shape.experts_per_token * shape.moe_intermediate_size)
    return in_flight, saved


def case_footprint(case: Case, config, phases: tuple[str, ...], arm: str = "baseline") -> Footprint:
    """Lower bound of the memory one arm ("baseline" or "dedup") of `case` needs to run `phases`,
    from its config's shapes. With padding, lengths are drawn in [P/2, P] and [1, R]: the
    bound takes the shortest."""
    shape = model_shape(config)
    width = getattr(torch, case.dtype).itemsize  # suite dtypes are torch's names
    backward = "forward_backward" in phases
    params = parameter_count(shape, bool(getattr(config, "tie_word_embeddings", False)))
    b, u = case.batch_size, case.unique_prompts
    p, r = (max(1, case.prompt_len // 2), 1) if case.padding else (case.prompt_len, case.response_len)
    tokens = b * (p + r) if arm == "baseline" else u * p + b * r  # the arm's packed row
    in_flight, saved = activation_widths(shape)
    activations = tokens * (saved if backward else in_flight) * width
    positions = tokens if case.actor.logits_mode == "none" else b * r
    logits = positions * shape.vocab_size * 4
    if case.actor.logits_mode == "memory":
        budget = case.actor.logits_memory_budget_mib or _MEMORY_MODE_DEFAULT_MIB
        logits = min(logits, int(budget * 2**20))
    return Footprint(
        weights=params * width * (2 if backward else 1),
        batch=b * (p + r) * 9,
        plan=tokens * 2 * 8,
        activations=activations,
        logits=logits,
    )


def available_memory() -> Optional[int]:
    """Bytes this machine can still hand out (MemAvailable, Linux); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def too_large(footprint: Footprint, max_memory: Optional[int], device: str) -> Optional[str]:
    """Why the case cannot fit (None: it may). `max_memory` is the user's limit in bytes; without
    it a CPU case is held to the memory this machine has available. On CUDA only the batch is
    built in host memory; the device's memory is the case process's to find out (the sweep
    never touches CUDA), unless --max-memory says it."""
    if max_memory is not None and footprint.total > max_memory:
        return f"needs at least {footprint.describe()}, more than the --max-memory limit of {gib(max_memory)}"
    host = footprint.batch if device.startswith("cuda") else footprint.total
    avail = available_memory()
    if avail is not None and host > avail:
        what = footprint.describe() if host == footprint.total else f"{gib(host)} of host memory for the batch"
        return f"needs at least {what}, more than the {gib(avail)} this machine has available"
    return None
