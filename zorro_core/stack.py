"""The cumulative optimization stack: each configuration adds one optimization to the row above.

    baseline -> +flash_attention -> +liger -> +dedup -> +split_attention

stack_table() turns benchmark rows into that table, with each row's step over the previous
row (tokens/s ratio, peak-memory delta) and its total over the baseline, so a user sees what
dedup adds on top of the stack they already run.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import pandas as pd

STACK = ("baseline", "+flash_attention", "+liger", "+dedup", "+split_attention")
REQUIRED = ("config", "tokens_per_s", "peak_mem_mib")
OUTPUT = ("config", "runs", "tokens_per_s", "peak_mem_mib", "step_speedup", "step_mem_delta_mib",
          "total_speedup", "total_mem_delta_mib", "status")


def stack_table(df: pd.DataFrame, by: Optional[Sequence[str]] = None, ok_status: str = "ok") -> pd.DataFrame:
    """The cumulative table of benchmark rows `df`.

    Input columns: `config` (one of STACK), `tokens_per_s`, `peak_mem_mib`; optional `status`
    (rows whose status is not `ok_status` are left out of the figures; a config with no good
    row is listed with its status and no figures), and the `by` columns (one stack per
    distinct combination, e.g. ["model", "prompt_len"]). Repeated rows of a config are
    summarized by their median.

    Output, per stack in STACK order (configs absent from the input are skipped): `by`
    columns, then OUTPUT: runs (good rows), tokens_per_s, peak_mem_mib (medians),
    step_speedup (tokens/s / previous row's), step_mem_delta_mib (peak memory minus the
    previous row's), total_speedup and total_mem_delta_mib (against the first row with
    figures, normally the baseline), status. The "previous row" is the nearest row above
    that has figures, so a failed configuration does not break the chain.
    """
    by = list(by or [])
    missing = [c for c in (*REQUIRED, *by) if c not in df.columns]
    if missing:
        raise ValueError(f"stack_table needs columns {missing}; got {list(df.columns)}")
    unknown = sorted(set(df["config"]) - set(STACK))
    if unknown:
        raise ValueError(f"unknown stack configs {unknown}; the stack is {list(STACK)}")
    df = df.copy()
    df["_ok"] = df["status"].eq(ok_status) if "status" in df.columns else True
    for col in ("tokens_per_s", "peak_mem_mib"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    df.loc[df["tokens_per_s"].isna(), "_ok"] = False
    groups = df.groupby(by, sort=True, dropna=False) if by else [((), df)]
    out = []
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        prev = first = None
        for config in STACK:
            rows = g[g["config"] == config]
            if rows.empty:
                continue
            good = rows[rows["_ok"]]
            row = dict(zip(by, key), config=config, runs=len(good))
            if good.empty:
                statuses = rows["status"].astype(str).unique() if "status" in rows.columns else ["no figures"]
                row.update(tokens_per_s=math.nan, peak_mem_mib=math.nan, status=",".join(sorted(statuses)))
            else:
                row.update(tokens_per_s=float(good["tokens_per_s"].median()), peak_mem_mib=float(good["peak_mem_mib"].median()),
                           status=ok_status)
            figures = not good.empty
            if figures and first is None:
                first = row  # the baseline's total is 1.0x / +0 MiB; its step has no row above
            ref_prev = prev if figures else None
            ref_first = first if figures else None
            row["step_speedup"] = row["tokens_per_s"] / ref_prev["tokens_per_s"] if ref_prev else math.nan
            row["step_mem_delta_mib"] = row["peak_mem_mib"] - ref_prev["peak_mem_mib"] if ref_prev else math.nan
            row["total_speedup"] = row["tokens_per_s"] / ref_first["tokens_per_s"] if ref_first else math.nan
            row["total_mem_delta_mib"] = row["peak_mem_mib"] - ref_first["peak_mem_mib"] if ref_first else math.nan
            if figures:
                prev = row
            out.append(row)
    return pd.DataFrame(out, columns=[*by, *OUTPUT])
