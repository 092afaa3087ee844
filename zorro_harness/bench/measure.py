"""Timing harness: warm up, alternate the arms, synchronize before every clock read, summarize.

A speedup is a ratio from one run: both arms are timed in the same process, interleaved
(ABBA order, so neither arm always runs first), and the speedup of round i is
baseline_i / dedup_i. The reported speedup is the median of those paired ratios (a slow
spell of the machine hits both arms of a round, so it cancels), p20/p80 are their spread,
and the uncertainty is the standard error of that median, estimated from the p20-p80 spread
(robust to the odd slow round). It can differ slightly from baseline_p50 / dedup_p50.

Peak memory, named by what it is (`peak_mem_kind`):
- CUDA: torch.cuda.max_memory_allocated over one run of the arm (weights included).
- CPU: peak RSS growth of one run in a fresh process: run the arm once untimed (so that code
  pages of the kernels it uses and one-time buffers are mapped: otherwise the figure moves by
  tens of MiB with the page cache's state), hand the freed heap back to the OS (malloc_trim),
  reset the high-water mark (write 5 to /proc/self/clear_refs), run again, read VmHWM minus
  the RSS before. Each arm and phase gets its own process (a process's heap history would
  otherwise leak into the next figure; tracemalloc does not see tensors).
"""

from __future__ import annotations

import ctypes
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

CUDA_PEAK_KIND = "cuda_max_memory_allocated"
CPU_PEAK_KIND = "cpu_peak_rss_growth_fresh_process"


@dataclass
class Stats:
    """Summary of repeated timings, in milliseconds."""

    p50: float
    p20: float
    p80: float
    n: int
    samples: list[float] = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        return f"{self.p50:.2f} ms [p20 {self.p20:.2f}, p80 {self.p80:.2f}, n={self.n}]"


def summarize(samples: Sequence[float]) -> Stats:
    """Median, p20 and p80 of the samples."""
    if len(samples) == 0:
        raise ValueError("no samples to summarize")
    a = np.asarray(samples, dtype=float)
    return Stats(
        float(np.median(a)), float(np.percentile(a, 20)), float(np.percentile(a, 80)), len(a), [float(x) for x in a]
    )


@dataclass
class Speedup:
    """baseline / dedup, from paired repeats."""

    value: float
    """Median of the paired ratios baseline_i / dedup_i."""
    err: float
    """Standard error of the median paired ratio (normal approximation from its p20-p80 spread)."""
    p20: float
    """20th percentile of the paired ratios."""
    p80: float
    """80th percentile of the paired ratios."""

    def __str__(self) -> str:
        return format_speedup(self.value, self.err)


LARGE = 1e6
"""From this magnitude on, figures are printed in scientific notation (a fixed-point 1e308 has 309 digits)."""


def format_number(value: float, digits: int = 2) -> str:
    """`value` with `digits` decimals, or in scientific notation (digits + 1 significant) when large."""
    if math.isfinite(value) and abs(value) >= LARGE:
        return f"{value:.{digits + 1}g}"
    return f"{value:.{digits}f}"


def format_speedup(value: float, err: float) -> str:
    if not math.isfinite(value):
        return "-"
    if abs(value) >= LARGE:
        return format_number(value) + (f" ± {err:.2g}x" if math.isfinite(err) else "x")
    if not math.isfinite(err):
        return f"{value:.2f}x"
    digits = 2 if err == 0 else max(2, min(4, -int(math.floor(math.log10(err)))))
    return f"{value:.{digits}f} ± {format_number(err, digits)}x"


# p20..p80 of a normal spans 2 x 0.8416 sigma; the median's standard error is 1.2533 sigma / sqrt(n).
_SPREAD_TO_SIGMA = 1.0 / (2 * 0.8416)
_MEDIAN_SE = 1.2533


def speedup(baseline_ms: Sequence[float], dedup_ms: Sequence[float]) -> Speedup:
    """Speedup of paired (interleaved) repeats."""
    if len(baseline_ms) != len(dedup_ms) or not baseline_ms:
        raise ValueError(
            f"need the same non-zero number of baseline and dedup repeats, got {len(baseline_ms)} and {len(dedup_ms)}"
        )
    b, d = np.asarray(baseline_ms, float), np.asarray(dedup_ms, float)
    ratios = b / d
    p20, p80 = float(np.percentile(ratios, 20)), float(np.percentile(ratios, 80))
    sigma = (p80 - p20) * _SPREAD_TO_SIGMA
    # Fewer than 3 rounds say nothing about the spread: no error rather than a false 0.
    err = _MEDIAN_SE * sigma / math.sqrt(len(ratios)) if len(ratios) >= 3 else float("nan")
    return Speedup(float(np.median(ratios)), err, p20, p80)


def time_columns(arm: str, stats: Stats) -> dict[str, float]:
    """One arm's timing columns of a result row: <arm>_ms_p50, _p20, _p80."""
    return {
        f"{arm}_ms_p50": round(stats.p50, 3),
        f"{arm}_ms_p20": round(stats.p20, 3),
        f"{arm}_ms_p80": round(stats.p80, 3),
    }


def speedup_columns(baseline_ms: Sequence[float], dedup_ms: Sequence[float], ideal: float) -> dict[str, float | str]:
    """The speedup columns of a result row: the paired speedup, its error ('' when unknown), its
    p20 and p80, and the efficiency (speedup / `ideal`, the cost model's)."""
    sp = speedup(baseline_ms, dedup_ms)
    return {
        "speedup": round(sp.value, 4),
        "speedup_err": round(sp.err, 4) if math.isfinite(sp.err) else "",
        "speedup_p20": round(sp.p20, 4),
        "speedup_p80": round(sp.p80, 4),
        "efficiency": round(sp.value / ideal, 4),
    }


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work, so that a clock read means the work is done."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_once(fn: Callable[[], object], device: torch.device | str) -> float:
    """Milliseconds of one call of fn, synchronized before both clock reads."""
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def self_timed(fn: Callable[[], object], device: torch.device | str) -> float:
    """Milliseconds of one call of an arm that times itself: fn returns its own seconds."""
    seconds = fn()
    if not isinstance(seconds, (int, float)):
        raise TypeError(f"a self-timed arm returns its seconds, got {type(seconds).__name__}")
    return float(seconds) * 1e3


def time_interleaved(
    arms: Mapping[str, Callable[[], object]],
    device: torch.device | str,
    warmup: int = 1,
    repeats: int = 5,
    between: Optional[Callable[[], None]] = None,
    clock: Callable[[Callable[[], object], torch.device | str], float] = time_once,
) -> dict[str, list[float]]:
    """Times of each arm over `repeats` rounds, arms alternating (order reversed every round).

    `between` runs before every call, outside the clock (e.g. zeroing gradients). `clock`: the
    milliseconds of one call (time_once; self_timed for arms that time their own step, as a step
    that prepares its input first or waits for the slowest rank does)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    # The collector off while timing (as timeit does): a full collection of a process that has
    # imported transformers takes ~0.1 s and would land in whichever call triggers it.
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(warmup + repeats):
            order = names if i % 2 == 0 else names[::-1]
            for name in order:
                if between is not None:
                    between()
                ms = clock(arms[name], device)
                if i >= warmup:
                    times[name].append(ms)
    finally:
        if was_enabled:
            gc.enable()
    return times


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    return proc_status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the RSS high-water mark of this process; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """High-water mark of the RSS since the last reset (VmHWM, Linux)."""
    return proc_status_kib("VmHWM") * 1024


def proc_status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{key} not found in /proc/self/status (peak RSS needs Linux)")


def release_free_memory() -> None:
    """Collect garbage and return glibc's free heap to the OS (no-op without glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_mib(fn: Callable[[], object], device: torch.device | str) -> tuple[float, str]:
    """(peak memory of one call of fn in MiB, what the figure is). On CPU call it in a fresh process."""
    device = torch.device(device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) / 2**20, CUDA_PEAK_KIND
    release_free_memory()
    if not reset_peak_rss():
        raise OSError("cannot reset the RSS high-water mark (/proc/self/clear_refs): peak memory needs Linux")
    before = rss_bytes()
    fn()
    return (peak_rss_bytes() - before) / 2**20, CPU_PEAK_KIND
