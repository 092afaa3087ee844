"""What `zorro verify` may start on this machine: a memory guard (as `bench` has) and a cap on ranks.

Both are checked before anything is allocated, and both are lower bounds, so a refusal is never
a false alarm:

- verify gradients/training builds each model in float32 (or bfloat16), then a float64 copy for
  the reference, which runs a backward: at least 4 + 8 + 8 bytes per parameter at once;
- verify distributed (and a bench case with nproc > 1) starts one process per rank, each
  importing torch (RANK_OVERHEAD) and holding the model in float64 before it is sharded. More
  ranks than CPU cores only oversubscribe the machine (every rank is a busy process).
"""

from __future__ import annotations

import os
from typing import Optional

from zorro_core.models.registry import model_shape
from zorro_harness.bench.footprint import GIB, available_memory, gib, parameter_count

RANK_OVERHEAD = 300 * 2**20
"""Resident memory of a process that has imported torch and transformers, measured ~350 MiB."""
VERIFY_BYTES_PER_PARAM = 4 + 8 + 8
"""float32 weights, their float64 copy, and its gradients (the reference's backward)."""


def _params(model: str) -> int:
    from zorro_harness.bench.inputs import model_config

    config = model_config(model)
    return parameter_count(model_shape(config), bool(getattr(config, "tie_word_embeddings", False)))


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover (not Linux)
        return os.cpu_count() or 1


def verify_too_large(models: list[str], available: Optional[int] = None) -> Optional[str]:
    """Why verifying `models` cannot fit in this machine's memory (None: it may). Models are
    verified one after the other: the largest decides."""
    avail = available_memory() if available is None else available
    if avail is None:
        return None
    need = {m: _params(m) * VERIFY_BYTES_PER_PARAM for m in dict.fromkeys(models)}
    worst = max(need, key=lambda m: need[m])
    if need[worst] > avail:
        return (
            f"verifying {worst} needs at least {gib(need[worst])} (float32 weights, a float64 copy and its "
            f"gradients: {VERIFY_BYTES_PER_PARAM} bytes x {_params(worst) / 1e9:.3g}B parameters), more than the "
            f"{gib(avail)} this machine has available; verify a smaller preset (tiny-*)"
        )
    return None


def ranks_over_cores(nproc: int, cores: Optional[int] = None, flag: str = "--nproc") -> Optional[str]:
    """Why `nproc` ranks are more than this machine's CPU cores can run (None: they are not)."""
    cores = cpu_cores() if cores is None else cores
    if nproc > 1 and nproc > cores:
        return (
            f"{flag} {nproc}: this machine has {cores} CPU core(s); more ranks than cores only oversubscribe it "
            f"(each rank is a busy process): use at most {cores}"
        )
    return None


def ranks_over_memory(
    nproc: int, model: str, bytes_per_param: int = 8, available: Optional[int] = None, flag: str = "--nproc"
) -> Optional[str]:
    """Why `nproc` ranks of `model` need more memory than the machine has (None: they may fit);
    each rank: RANK_OVERHEAD + the model at `bytes_per_param` before it is sharded."""
    avail = available_memory() if available is None else available
    if nproc <= 1 or avail is None:
        return None
    per_rank = RANK_OVERHEAD + _params(model) * bytes_per_param
    if nproc * per_rank > avail:
        return (
            f"{flag} {nproc}: {nproc} ranks of {model} need at least {gib(nproc * per_rank)} "
            f"({gib(per_rank)} each), more than the {gib(avail)} this machine has available: "
            f"use at most {max(0, avail // per_rank)}"
        )
    return None


def ranks_too_many(nproc: int, model: str, bytes_per_param: int = 8, flag: str = "--nproc") -> Optional[str]:
    """ranks_over_cores, then ranks_over_memory."""
    return ranks_over_cores(nproc, flag=flag) or ranks_over_memory(nproc, model, bytes_per_param, flag=flag)


__all__ = [
    "GIB",
    "RANK_OVERHEAD",
    "cpu_cores",
    "ranks_over_cores",
    "ranks_over_memory",
    "ranks_too_many",
    "verify_too_large",
]
