"""The cumulative optimization stack: each configuration adds one optimization to the row above.

    baseline -> +flash_attention -> +liger -> +dedup -> +split_attention

stack_table() turns benchmark rows into that table, with each row's step over the previous
row (tokens/s ratio, peak-memory delta) and its total over the baseline, so a user sees what
dedup adds on top of the stack they already run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import pandas as pd

STACK = ("baseline", "+flash_attention", "+liger", "+dedup", "+split_attention")
REQUIRED = ("config", "tokens_per_s", "peak_mem_mib")
OUTPUT = (
    "config",
    "runs",
    "tokens_per_s",
    "peak_mem_mib",
    "step_speedup",
    "step_mem_delta_mib",
    "total_speedup",
    "total_mem_delta_mib",
    "status",
)


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
        prev: Optional[dict] = None
        first: Optional[dict] = None
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
                row.update(
                    tokens_per_s=float(good["tokens_per_s"].median()),
                    peak_mem_mib=float(good["peak_mem_mib"].median()),
                    status=ok_status,
                )
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


# ---------------------------------------------------------------- from benchmark rows


@dataclass(frozen=True)
class StackAttention:
    """Which attention implementation plays each part of the stack on a device."""

    plain: str
    """The baseline's attention (what a trainer runs without flash-attn)."""
    flash: str
    """The "+flash_attention" row's attention, and the split-mode dedup's."""
    mask: str
    """The attention of the "+dedup" row (mask mode: one masked call; flash-attn has no mask mode)."""


# cuda: sdpa -> flash-attn 2; mask mode through FlexAttention (BlockMask, empty blocks skipped).
# cpu: no flash-attn, so eager -> sdpa (PyTorch's CPU SDPA is a flash-style fused kernel); mask mode sdpa.
STACK_ATTENTION = {
    "cuda": StackAttention(plain="sdpa", flash="flash_attention_2", mask="flex_attention"),
    "cpu": StackAttention(plain="eager", flash="sdpa", mask="sdpa"),
}

# config -> (arm, attention part, dedup arm's mode (None: any; the baseline arm is packed varlen either way), liger)
STACK_SOURCES = {
    "baseline": ("baseline", "plain", None, False),
    "+flash_attention": ("baseline", "flash", None, False),
    "+liger": ("baseline", "flash", None, True),
    "+dedup": ("dedup", "mask", False, True),
    "+split_attention": ("dedup", "flash", True, True),
}
# The workload: one stack per distinct combination (the attention, mode and liger vary within it).
WORKLOAD = (
    "model",
    "dtype",
    "device",
    "batch_size",
    "num_unique_prompts",
    "prompt_len",
    "response_len",
    "padding",
    "logits_mode",
    "phase",
)
SOURCE_COLUMNS = ("source", "label", "note")


def _flag(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def _arm_status(row: pd.Series, arm: str) -> str:
    """A row's status for one arm: an `oom` row still carries the arm that fit."""
    status = str(row.get("status", "ok"))
    has = pd.notna(pd.to_numeric(row.get(f"{arm}_tokens_per_s"), errors="coerce"))
    if status == "ok" or (status == "oom" and has):
        return "ok" if has else "no figures"
    return status


def stack_rows_from_bench(df: pd.DataFrame, attention: Optional[dict[str, StackAttention]] = None) -> pd.DataFrame:
    """The one-row-per-config frame stack_table wants, from benchmark rows of two arms each.

    Per workload (WORKLOAD columns) and the row's device (`attention` maps a device type to a
    StackAttention; default STACK_ATTENTION):
      baseline          baseline arm of the plain-attention case without liger
      +flash_attention  baseline arm of the flash case without liger
      +liger            baseline arm of the flash case with liger
      +dedup            dedup arm of the mask-mode case (mask attention) with liger
      +split_attention  dedup arm of the split-mode flash case with liger
    The baseline arm is BaselineActor packed without padding, so the rows above +dedup differ
    only in attention and liger. Where every liger row of +dedup or +split_attention failed or
    was skipped (no GPU) and the same case without liger ran, that one is used and `note` says
    so: the stack goes on without liger instead of stopping. Output: WORKLOAD columns, config,
    tokens_per_s, peak_mem_mib, status, error, source ("<arm> arm of <case_id>"), label (short
    source) and note.
    """
    attention = attention or STACK_ATTENTION
    need = ["case_id", "attn_implementation", "split_attention", "status"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ValueError(f"not benchmark rows: missing columns {missing}")
    df = df.copy()
    df["liger"] = df["liger"].map(_flag) if "liger" in df.columns else False
    df["split_attention"] = df["split_attention"].map(_flag)
    by = [c for c in WORKLOAD if c in df.columns]
    df[by] = df[by].fillna("")
    out = []
    for key, g in df.groupby(by, sort=False, dropna=False) if by else [((), df)]:
        key = key if isinstance(key, tuple) else (key,)
        device = str(dict(zip(by, key)).get("device", "cpu")).split(":")[0] or "cpu"
        roles = attention.get(device)
        if roles is None:
            raise ValueError(f"no stack attention for device {device!r} (known: {', '.join(attention)})")
        for config, (arm, part, split, liger) in STACK_SOURCES.items():
            pick = _pick(g, arm, getattr(roles, part), split, liger, fallback=config in ("+dedup", "+split_attention"))
            if pick is None:
                continue
            rows, note = pick
            for _, r in rows.iterrows():
                out.append(
                    dict(
                        zip(by, key),
                        config=config,
                        tokens_per_s=r.get(f"{arm}_tokens_per_s"),
                        peak_mem_mib=r.get(f"{arm}_peak_mem_mib"),
                        status=_arm_status(r, arm),
                        error="" if pd.isna(r.get("error")) else str(r.get("error", "")),
                        source=f"{arm} arm of {r['case_id']}",
                        label=_label(arm, r),
                        note=note,
                    )
                )
    return pd.DataFrame(
        out, columns=[*by, "config", "tokens_per_s", "peak_mem_mib", "status", "error", *SOURCE_COLUMNS]
    )


def _label(arm: str, r: pd.Series) -> str:
    """Short name of an arm of a case, e.g. "dedup: flex_attention mask + liger" (the workload is the stack's)."""
    what = "packed" if arm == "baseline" else ("split" if r["split_attention"] else "mask")
    return f"{arm}: {r['attn_implementation']} {what}{' + liger' if r['liger'] else ''}"


def _pick(g: pd.DataFrame, arm: str, attn: str, split: Optional[bool], liger: bool, fallback: bool):
    """The rows of the case(s) for one config, and a note; None when there are none."""

    def rows(with_liger: bool) -> pd.DataFrame:
        sel = (g["attn_implementation"] == attn) & (g["liger"] == with_liger)
        if split is not None:
            sel &= g["split_attention"] == split
        return g[sel]

    def any_ok(r: pd.DataFrame) -> bool:
        return any(_arm_status(x, arm) == "ok" for _, x in r.iterrows())

    chosen = rows(liger)
    if liger and fallback and not any_ok(chosen):
        plain = rows(False)
        if any_ok(plain):
            why = ", ".join(sorted(set(chosen["status"].astype(str)))) if len(chosen) else "not in the results"
            return plain, f"without liger (liger case: {why})"
    return (chosen, "") if len(chosen) else None


def stack_need(config: str, device: str = "cpu", attention: Optional[dict[str, StackAttention]] = None) -> str:
    """The benchmark case and arm stack row `config` comes from on `device` (None if the device has no stack)."""
    roles = (attention or STACK_ATTENTION).get(device.split(":")[0] or "cpu")
    if roles is None:
        return f"{config}: no stack attention for device {device!r}"
    arm, part, split, liger = STACK_SOURCES[config]
    mode = "" if split is None else (", split_attention=true" if split else ", split_attention=false")
    return f"{config}: {arm} arm of attn_implementation={getattr(roles, part)}{mode}, liger={str(liger).lower()}"


def stack_needs(devices: Sequence[str] = ("cpu",), attention: Optional[dict[str, StackAttention]] = None) -> str:
    """The cases a stack sweep holds, per workload, on each of `devices` (what `report stack` says
    is missing when results hold none of them)."""
    attention = attention or STACK_ATTENTION
    parts = []
    for device in dict.fromkeys(d.split(":")[0] or "cpu" for d in devices):
        if device in attention:
            parts.append(f"on {device}: " + "; ".join(stack_need(c, device, attention) for c in STACK_SOURCES))
    return " | ".join(parts)


def missing_configs(present: Sequence[str], device: str = "cpu") -> Optional[str]:
    """A note naming the stack configs a workload's results lack and the case each needs, or None."""
    absent = [c for c in STACK if c not in set(present)]
    if not absent:
        return None
    return "not in these results: " + "; ".join(stack_need(c, device) for c in absent)


def stack_report(df: pd.DataFrame, attention: Optional[dict[str, StackAttention]] = None) -> pd.DataFrame:
    """stack_table over stack_rows_from_bench(df), one stack per workload, with each row's source,
    note and (for rows without figures) the reason."""
    rows = stack_rows_from_bench(df, attention)
    by = [c for c in WORKLOAD if c in rows.columns]
    table = stack_table(rows, by=by)
    extra = (
        rows.groupby([*by, "config"], sort=False, dropna=False)
        .agg(
            source=("source", lambda s: "; ".join(dict.fromkeys(s))),
            label=("label", lambda s: "; ".join(dict.fromkeys(s))),
            note=("note", lambda s: "; ".join(dict.fromkeys(x for x in s if x))),
            reason=("error", lambda s: "; ".join(dict.fromkeys(x for x in s if x))),
        )
        .reset_index()
    )
    table = table.merge(extra, on=[*by, "config"], how="left")
    table.loc[table["status"] == "ok", "reason"] = ""
    return table
