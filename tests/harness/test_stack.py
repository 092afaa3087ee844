"""The cumulative stack table from hand-made benchmark rows."""

import io
import math

import pandas as pd
import pytest

from zorro_harness.bench.stack_table import (
    OUTPUT,
    STACK,
    StackAttention,
    stack_report,
    stack_rows_from_bench,
    stack_table,
)

# The Gym paper's first three rows (7B, A100 40GB), then made-up dedup rows; memory in MiB.
CSV = """config,tokens_per_s,peak_mem_mib,status
+liger,2400,33000,ok
baseline,1450,39117,ok
+flash_attention,2100,36000,ok
+dedup,4800,30000,ok
+split_attention,5760,28000,ok
"""


def test_cumulative_steps():
    t = stack_table(pd.read_csv(io.StringIO(CSV)))
    assert list(t.columns) == list(OUTPUT)
    assert list(t["config"]) == list(STACK)  # stack order, whatever the input order
    assert math.isnan(t["step_speedup"][0]) and t["total_speedup"][0] == 1.0 and t["total_mem_delta_mib"][0] == 0
    assert t["step_speedup"].tolist()[1:] == pytest.approx([2100 / 1450, 2400 / 2100, 4800 / 2400, 5760 / 4800])
    assert t["step_mem_delta_mib"].tolist()[1:] == [36000 - 39117, 33000 - 36000, 30000 - 33000, 28000 - 30000]
    assert t["total_speedup"].iloc[-1] == pytest.approx(5760 / 1450)
    assert t["total_mem_delta_mib"].iloc[-1] == 28000 - 39117
    assert (t["runs"] == 1).all() and (t["status"] == "ok").all()


def test_repeats_use_the_median_and_failures_are_skipped_in_the_chain():
    df = pd.DataFrame(
        [
            dict(config="baseline", tokens_per_s=100, peak_mem_mib=1000, status="ok"),
            dict(config="baseline", tokens_per_s=110, peak_mem_mib=1000, status="ok"),
            dict(config="baseline", tokens_per_s=400, peak_mem_mib=1000, status="ok"),
            dict(config="+liger", tokens_per_s=None, peak_mem_mib=None, status="oom"),
            dict(config="+dedup", tokens_per_s=220, peak_mem_mib=700, status="ok"),
        ]
    )
    t = stack_table(df).set_index("config")
    assert list(t.index) == ["baseline", "+liger", "+dedup"]  # absent configs are skipped
    assert t.loc["baseline", "tokens_per_s"] == 110 and t.loc["baseline", "runs"] == 3
    assert t.loc["+liger", "status"] == "oom" and math.isnan(t.loc["+liger", "step_speedup"])
    assert t.loc["+dedup", "step_speedup"] == pytest.approx(2.0)  # over baseline, the last row with figures
    assert t.loc["+dedup", "step_mem_delta_mib"] == -300


def test_one_stack_per_case():
    df = pd.DataFrame(
        [
            dict(model=m, config=c, tokens_per_s=v * k, peak_mem_mib=10 * k)
            for m, k in (("a", 1), ("b", 2))
            for c, v in (("baseline", 10), ("+dedup", 30))
        ]
    )
    t = stack_table(df, by=["model"])
    assert list(t.columns) == ["model", *OUTPUT]
    assert t["step_speedup"].tolist()[1::2] == pytest.approx([3.0, 3.0])
    assert t["tokens_per_s"].tolist() == [10, 30, 20, 60]


def test_without_status_column():
    t = stack_table(pd.DataFrame(dict(config=["baseline", "+dedup"], tokens_per_s=[1.0, 2.0], peak_mem_mib=[5.0, 4.0])))
    assert t["step_speedup"][1] == 2.0 and t["step_mem_delta_mib"][1] == -1.0


@pytest.mark.parametrize(
    "df,match",
    [
        (pd.DataFrame(dict(config=["baseline"], tokens_per_s=[1.0])), "peak_mem_mib"),
        (pd.DataFrame(dict(config=["+unsloth"], tokens_per_s=[1.0], peak_mem_mib=[1.0])), "unknown stack configs"),
    ],
)
def test_bad_input(df, match):
    with pytest.raises(ValueError, match=match):
        stack_table(df)


# ---------------------------------------------------------------- from benchmark rows (two arms each)


def bench_row(attn, split, liger, base_tps, dedup_tps, status="ok", device="cpu", phase="forward_backward", error=""):
    mode = "split" if split else "mask"
    return dict(
        case_id=f"m:{attn}:{mode}:compute:float32:{device}:b8u2p512r64" + (":liger" if liger else ""),
        model="m",
        dtype="float32",
        device=device,
        batch_size=8,
        num_unique_prompts=2,
        prompt_len=512,
        response_len=64,
        padding=False,
        logits_mode="compute",
        phase=phase,
        attn_implementation=attn,
        split_attention=split,
        liger=liger,
        status=status,
        error=error,
        baseline_tokens_per_s=base_tps,
        dedup_tokens_per_s=dedup_tps,
        baseline_peak_mem_mib=None if base_tps is None else 1e6 / base_tps,
        dedup_peak_mem_mib=None if dedup_tps is None else 1e6 / dedup_tps,
    )


NO_GPU = "Liger kernels are Triton kernels and need a CUDA GPU (got cpu)"
CPU_BENCH = pd.DataFrame(
    [  # what suites/stack_cpu.toml writes on a machine without a GPU
        bench_row("eager", True, False, 2500, 8000),
        bench_row("sdpa", True, False, 3200, 8800),
        bench_row("sdpa", True, True, None, None, "skipped", error=NO_GPU),
        bench_row("sdpa", False, False, 3300, 6000),
        bench_row("sdpa", False, True, None, None, "skipped", error=NO_GPU),
    ]
)


def test_cpu_stack_from_bench_rows_with_skipped_liger():
    rows = stack_rows_from_bench(CPU_BENCH).set_index("config")
    assert (
        rows.loc["baseline", "tokens_per_s"] == 2500
        and rows.loc["baseline", "source"] == "baseline arm of m:eager:split:compute:float32:cpu:b8u2p512r64"
    )
    assert sorted(rows.loc["+flash_attention", "tokens_per_s"]) == [3200, 3300]  # both sdpa cases' baseline arms
    assert (rows.loc["+liger", "status"] == "skipped").all()
    # Liger cannot run here: +dedup and +split_attention come from the same cases without liger, and say so.
    assert rows.loc["+dedup", "tokens_per_s"] == 6000 and rows.loc["+dedup", "source"].startswith(
        "dedup arm of m:sdpa:mask:"
    )
    assert (
        rows.loc["+split_attention", "tokens_per_s"] == 8800
        and rows.loc["+split_attention", "label"] == "dedup: sdpa split"
    )
    assert rows.loc["+dedup", "note"] == rows.loc["+split_attention", "note"] == "without liger (liger case: skipped)"

    t = stack_report(CPU_BENCH).set_index("config")
    assert (
        list(t.index) == list(STACK)
        and t.loc["+flash_attention", "tokens_per_s"] == 3250
        and t.loc["+flash_attention", "runs"] == 2
    )
    assert (
        t.loc["+liger", "status"] == "skipped" and t.loc["+liger", "reason"] == NO_GPU and t.loc["+liger", "runs"] == 0
    )
    assert t.loc["+dedup", "step_speedup"] == pytest.approx(6000 / 3250)  # over +flash_attention: the chain goes on
    assert t.loc["+split_attention", "step_speedup"] == pytest.approx(8800 / 6000)
    assert t.loc["+split_attention", "total_speedup"] == pytest.approx(8800 / 2500)
    assert t.loc["+dedup", "step_mem_delta_mib"] == pytest.approx(1e6 / 6000 - (1e6 / 3200 + 1e6 / 3300) / 2)


def test_gpu_stack_uses_liger_cases_and_carries_an_oom_arm():
    df = pd.DataFrame(
        [
            bench_row("sdpa", True, False, 1000, 2500, device="cuda"),
            bench_row("flash_attention_2", True, False, 1500, 4000, device="cuda"),
            # The baseline arm ran out of memory; the dedup arm fit and was timed.
            bench_row(
                "flash_attention_2",
                True,
                True,
                None,
                4400,
                status="oom",
                device="cuda",
                error="baseline: OutOfMemoryError",
            ),
            bench_row("flex_attention", False, True, 1400, 3600, device="cuda"),
            bench_row("flex_attention", False, False, 1300, 3000, device="cuda"),
            bench_row("eager", True, False, 500, 900, device="cuda"),  # not part of the GPU stack
        ]
    )
    t = stack_report(df).set_index("config")
    assert t["tokens_per_s"].tolist()[:2] == [1000, 1500] and math.isnan(t.loc["+liger", "tokens_per_s"])
    assert t.loc["+liger", "status"] == "oom" and "OutOfMemoryError" in t.loc["+liger", "reason"]
    assert t.loc["+dedup", "tokens_per_s"] == 3600 and t.loc["+dedup", "note"] == ""  # the liger case, no fallback
    assert t.loc["+split_attention", "tokens_per_s"] == 4400 and t.loc["+split_attention", "status"] == "ok"
    assert t.loc["+dedup", "step_speedup"] == pytest.approx(3600 / 1500)
    assert "eager" not in " ".join(t["source"])


def test_one_stack_per_workload_and_phase_and_no_fallback_without_a_plain_case():
    df = pd.concat([CPU_BENCH.assign(phase="forward"), CPU_BENCH.assign(phase="forward_backward", prompt_len=1024)])
    t = stack_report(df)
    assert len(t) == 10 and t.groupby(["phase", "prompt_len"]).size().tolist() == [5, 5]
    r = stack_report(CPU_BENCH.drop(index=3)).set_index("config")  # no sdpa mask case without liger
    assert r.loc["+dedup", "status"] == "skipped" and r.loc["+dedup", "note"] == ""  # nothing to fall back on


def test_bench_rows_bad_input():
    with pytest.raises(ValueError, match="not benchmark rows"):
        stack_rows_from_bench(pd.DataFrame(dict(config=["baseline"])))
    with pytest.raises(ValueError, match="no stack attention for device 'mps'"):
        stack_rows_from_bench(CPU_BENCH.assign(device="mps"))
    custom = {"cpu": StackAttention(plain="sdpa", flash="sdpa", mask="sdpa")}
    assert stack_rows_from_bench(CPU_BENCH, custom).set_index("config").loc["baseline", "tokens_per_s"].tolist() == [
        3200,
        3300,
    ]
