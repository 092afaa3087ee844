"""The cumulative stack table from hand-made benchmark rows."""

import io
import math

import pandas as pd
import pytest

from zorro_core.stack import OUTPUT, STACK, stack_table

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
    df = pd.DataFrame([
        dict(config="baseline", tokens_per_s=100, peak_mem_mib=1000, status="ok"),
        dict(config="baseline", tokens_per_s=110, peak_mem_mib=1000, status="ok"),
        dict(config="baseline", tokens_per_s=400, peak_mem_mib=1000, status="ok"),
        dict(config="+liger", tokens_per_s=None, peak_mem_mib=None, status="oom"),
        dict(config="+dedup", tokens_per_s=220, peak_mem_mib=700, status="ok"),
    ])
    t = stack_table(df).set_index("config")
    assert list(t.index) == ["baseline", "+liger", "+dedup"]  # absent configs are skipped
    assert t.loc["baseline", "tokens_per_s"] == 110 and t.loc["baseline", "runs"] == 3
    assert t.loc["+liger", "status"] == "oom" and math.isnan(t.loc["+liger", "step_speedup"])
    assert t.loc["+dedup", "step_speedup"] == pytest.approx(2.0)  # over baseline, the last row with figures
    assert t.loc["+dedup", "step_mem_delta_mib"] == -300


def test_one_stack_per_case():
    df = pd.DataFrame([dict(model=m, config=c, tokens_per_s=v * k, peak_mem_mib=10 * k)
                       for m, k in (("a", 1), ("b", 2)) for c, v in (("baseline", 10), ("+dedup", 30))])
    t = stack_table(df, by=["model"])
    assert list(t.columns) == ["model", *OUTPUT]
    assert t["step_speedup"].tolist()[1::2] == pytest.approx([3.0, 3.0])
    assert t["tokens_per_s"].tolist() == [10, 30, 20, 60]


def test_without_status_column():
    t = stack_table(pd.DataFrame(dict(config=["baseline", "+dedup"], tokens_per_s=[1.0, 2.0], peak_mem_mib=[5.0, 4.0])))
    assert t["step_speedup"][1] == 2.0 and t["step_mem_delta_mib"][1] == -1.0


@pytest.mark.parametrize("df,match", [
    (pd.DataFrame(dict(config=["baseline"], tokens_per_s=[1.0])), "peak_mem_mib"),
    (pd.DataFrame(dict(config=["+unsloth"], tokens_per_s=[1.0], peak_mem_mib=[1.0])), "unknown stack configs"),
])
def test_bad_input(df, match):
    with pytest.raises(ValueError, match=match):
        stack_table(df)
