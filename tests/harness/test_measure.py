"""Timing statistics, interleaving, and the peak-memory probes."""

import math

import numpy as np
import pytest
import torch

from zorro_harness.bench.measure import (
    CPU_PEAK_KIND,
    format_speedup,
    peak_memory_mib,
    speedup,
    summarize,
    time_interleaved,
)


def test_summarize():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.p50, s.n) == (3.0, 5)
    assert s.p20 == pytest.approx(np.percentile([1, 2, 3, 4, 5], 20))
    with pytest.raises(ValueError):
        summarize([])


def test_speedup_is_paired_and_has_an_error():
    base = [10.0, 20.0, 10.0, 20.0, 10.0]  # the machine slows down in rounds 2 and 4 for both arms
    dedup = [5.0, 10.0, 5.0, 10.0, 5.0]
    sp = speedup(base, dedup)
    assert sp.value == pytest.approx(2.0) and sp.err == pytest.approx(0.0)  # the drift cancels
    noisy = speedup([10, 11, 9, 10.5, 9.5], [5, 5, 5, 5, 5])
    assert noisy.value == pytest.approx(2.0) and 0 < noisy.err < 0.2 and noisy.p20 < 2 < noisy.p80
    assert format_speedup(3.4123, 0.0512) == "3.41 ± 0.05x"
    assert format_speedup(float("nan"), 0) == "-" and format_speedup(2.0, float("nan")) == "2.00x"
    assert math.isnan(speedup([2.0, 2.0], [1.0, 1.0]).err)  # two rounds: no spread to speak of
    with pytest.raises(ValueError):
        speedup([1.0], [1.0, 2.0])


def test_time_interleaved_alternates_and_warms_up():
    calls = []
    arms = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    times = time_interleaved(arms, "cpu", warmup=1, repeats=3)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert [len(t) for t in times.values()] == [3, 3] and all(x >= 0 for t in times.values() for x in t)


def test_cpu_peak_memory_sees_a_tensor():
    mib, kind = peak_memory_mib(lambda: torch.ones(64 * 2**20 // 4).sum(), "cpu")  # 64 MiB, freed after
    assert kind == CPU_PEAK_KIND
    assert 48 < mib < 200
