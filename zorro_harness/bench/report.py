"""Report logic over results files: merge them, pivot a value by dedup ratio x prompt length,
plot speedup and memory, compare two runs case by case (`zorro report` prints these)."""

from __future__ import annotations

import io
import math
import re
from pathlib import Path

from zorro_harness.bench.files import replace_atomically
from zorro_harness.bench.measure import format_speedup
from zorro_harness.bench.results import (
    SETUP_COLUMNS,
    check_fields,
    from_spreadsheet_cell,
    read_results_text,
    spreadsheet_cell,
)
from zorro_harness.bench.sidecar import read_sidecar, sidecar_path

# Columns that define a configuration: one pivot table (and one plot) per combination.
GROUP_COLUMNS = [
    *SETUP_COLUMNS,
    "response_len",
    "padding",
    "baseline_kind",
    "sharing",
    "shared_prefix_len",
]
KEY = ["case_id", "phase"]


def load_results(paths: list[Path]):
    """All rows of the CSVs, the last row of each (case_id, phase) kept. ValueError naming the
    file when one is missing, a directory, empty, binary, damaged (a cut or ragged line) or not
    a zorro results CSV."""
    import pandas as pd  # lazy here and below: pandas/matplotlib slow the CLI's start-up

    frames = []
    for p in paths:
        text = read_results_text(p)
        check_fields(p, text)  # every line whole, with the header's number of fields
        try:
            df = pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=[""])
        except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
            raise ValueError(f"{p}: not a readable CSV ({str(e).strip()})") from None
        missing = [c for c in KEY + ["status"] if c not in df.columns]
        if missing:
            raise ValueError(f"{p} is not a zorro results CSV (missing columns {missing})")
        unquote_cells(df)
        check_values(df, p)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    df = df.drop_duplicates(subset=KEY, keep="last").reset_index(drop=True)
    for col in GROUP_COLUMNS:
        if col not in df.columns:
            df[col] = ""
    df[GROUP_COLUMNS] = df[GROUP_COLUMNS].fillna("")
    return df


def _text_columns(df) -> list:
    import pandas as pd

    return [c for c in df.columns if df[c].dtype == object or pd.api.types.is_string_dtype(df[c])]


def unquote_cells(df) -> None:
    """In place: the text cells as they were before results.spreadsheet_cell quoted them."""
    for col in _text_columns(df):
        s = df[col]
        quoted = s.str.match(r"'[=+\-@\t\r']", na=False)
        if quoted.any():
            df[col] = s.where(~quoted, s[quoted].map(from_spreadsheet_cell))


def spreadsheet_frame(df):
    """A copy of `df` whose text cells are spreadsheet-safe (results.spreadsheet_cell; numbers as they are)."""
    out = df.copy()
    for col in _text_columns(out):
        out[col] = out[col].map(lambda v: spreadsheet_cell(v) if isinstance(v, str) else v)
    return out


# Numeric columns of an ok row, and the least each may be: times, rates and speedups are > 0.
POSITIVE = [
    *(f"{arm}_ms_{q}" for arm in ("baseline", "dedup") for q in ("p50", "p20", "p80")),
    "speedup",
    "speedup_p20",
    "speedup_p80",
    "ideal_speedup",
    "efficiency",
    "baseline_tokens_per_s",
    "dedup_tokens_per_s",
    "prompt_len",
    "response_len",
    "batch_size",
]
NON_NEGATIVE = ["speedup_err", "baseline_peak_mem_mib", "dedup_peak_mem_mib", "baseline_gflops", "dedup_gflops"]


def check_values(df, path) -> None:
    """ValueError naming the file, the line and the column of the first impossible value of an ok
    row: text, NaN or infinity in a numeric column, a time, rate or speedup <= 0, a negative
    error or memory, a prompt dedup ratio outside [0, 1)."""
    import pandas as pd

    ok = df[df["status"].astype(str) == "ok"]
    for col in [*POSITIVE, *NON_NEGATIVE, "prompt_dedup_ratio"]:
        if col not in ok.columns:
            continue
        raw = ok[col]
        if pd.api.types.is_numeric_dtype(raw):  # read as numbers: no text to look for (fast on big files)
            given, num = raw.notna(), raw
        else:
            given = raw.notna() & (raw.astype(str).str.strip() != "")
            num = pd.to_numeric(raw.where(given), errors="coerce")
        if col in POSITIVE:
            bad, need = ~(num > 0), "a finite number > 0"
        elif col in NON_NEGATIVE:
            bad, need = ~(num >= 0), "a finite number >= 0"
        else:
            bad, need = ~((num >= 0) & (num < 1)), "a number in [0, 1)"
        bad = given & (bad | num.isin([float("inf"), float("-inf")]))
        if bad.any():
            i = bad.idxmax()
            raise ValueError(
                f"{path}: impossible value {raw[i]!r} in column {col} of an ok row (line {i + 2}, "
                f"{df.at[i, 'case_id']} {df.at[i, 'phase']}): it must be {need}; {int(bad.sum())} such row(s)"
            )


def _fmt(v: float, err: float | None = None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return format_speedup(float(v), float("nan") if err is None else float(err))


def group_title(key: tuple) -> str:
    d = dict(zip(GROUP_COLUMNS + ["phase"], key))
    split = "split" if str(d["split_attention"]).lower() == "true" else "mask"
    pad = ", padded lengths" if str(d["padding"]).lower() == "true" else ""
    sharing = f" sharing={d['sharing']}" if d["sharing"] not in ("", "prompt") else ""
    shared = str(d["shared_prefix_len"])
    system = f", shared prefix {int(float(shared))}" if shared not in ("", "0", "0.0") else ""
    return (
        f"{d['model']} {d['attn_implementation']}/{split}{sharing} logits={d['logits_mode']} {d['dtype']} {d['device']} "
        f"B={d['batch_size']} R={d['response_len']}{pad}{system} vs {d['baseline_kind'] or 'baseline'}: {d['phase']}"
    )


def pivots(df, value: str = "speedup"):
    """[(title, group key, pivot DataFrame of 'value ± err' strings, numeric pivot)] per configuration and phase."""
    ok = df[df["status"] == "ok"].copy()
    if ok.empty:
        return []
    ok["ratio"] = ok["prompt_dedup_ratio"].astype(float).round(3)
    err_col = {"speedup": "speedup_err"}.get(value)
    out = []
    for key, g in ok.groupby(GROUP_COLUMNS + ["phase"], sort=True, dropna=False):
        num = g.pivot_table(index="ratio", columns="prompt_len", values=value, aggfunc="mean").sort_index()
        if err_col and err_col in g.columns:
            err = g.pivot_table(index="ratio", columns="prompt_len", values=err_col, aggfunc="mean").reindex_like(num)
            text = num.copy().astype(object)
            for c in num.columns:
                text[c] = [_fmt(x, y) for x, y in zip(num[c], err[c])]
        else:
            text = num.map(lambda x: "" if math.isnan(x) else f"{x:.3g}")
        out.append((group_title(key), key, text, num))
    return out


def pivot_frame(tables, value: str):
    """The pivots of `pivots(df, value)` as one DataFrame: a row per configuration and dedup
    ratio, a column `<value>_P<prompt_len>` per prompt length."""
    import pandas as pd

    frames = []
    for _, key, _, num in tables:
        wide = num.copy()
        wide.columns = [f"{value}_P{c}" for c in wide.columns]
        wide = wide.reset_index().rename(columns={"ratio": "prompt_dedup_ratio"})
        for col, v in reversed(list(zip(GROUP_COLUMNS + ["phase"], key))):
            wide.insert(0, col, v)
        frames.append(wide)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")[:120]


def plot(df, out_dir: Path) -> list[Path]:
    """Speedup vs prompt dedup ratio per prompt length (p20-p80 bands, ideal dashed), and peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ok = df[df["status"] == "ok"].copy()
    written: list[Path] = []
    if ok.empty:
        return written
    ok["ratio"] = ok["prompt_dedup_ratio"].astype(float)
    for key, g in ok.groupby(GROUP_COLUMNS, sort=True, dropna=False):
        phases = [p for p in ("forward", "forward_backward") if p in set(g["phase"])]
        title = group_title(tuple(key) + ("",)).rsplit(":", 1)[0]
        name = _slug(
            f"{key[0]}_{key[1]}_{'split' if str(key[2]).lower() == 'true' else 'mask'}_{key[3]}_{key[4]}_{key[5]}_b{key[6]}_r{key[7]}"
        )
        fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), squeeze=False)
        for ax, phase in zip(axes[0], phases):
            gp = g[g["phase"] == phase]
            for i, (plen, gl) in enumerate(sorted(gp.groupby("prompt_len"), key=lambda x: x[0])):
                gl = gl.sort_values("ratio")
                color = f"C{i}"
                ax.plot(gl["ratio"], gl["speedup"], "o-", color=color, label=f"P={plen}")
                if {"speedup_p20", "speedup_p80"} <= set(gl.columns):
                    ax.fill_between(gl["ratio"], gl["speedup_p20"], gl["speedup_p80"], color=color, alpha=0.2, lw=0)
                ax.plot(gl["ratio"], gl["ideal_speedup"], "--", color=color, alpha=0.6, lw=1)
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xlabel("prompt dedup ratio")
            ax.set_ylabel("speedup (baseline / dedup)")
            ax.set_title(phase.replace("forward_backward", "forward+backward"))
            ax.grid(alpha=0.3)
            ax.legend(title="dashed: ideal (FLOPs)\nband: p20-p80", fontsize=8, title_fontsize=7)
        written.append(_save(fig, title, out_dir / f"speedup_{name}.png"))

        mem = (
            g.dropna(subset=["baseline_peak_mem_mib", "dedup_peak_mem_mib"])
            if "dedup_peak_mem_mib" in g
            else g.iloc[0:0]
        )
        if mem.empty:
            continue
        fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), squeeze=False)
        for ax, phase in zip(axes[0], phases):
            gp = mem[mem["phase"] == phase]
            for i, (plen, gl) in enumerate(sorted(gp.groupby("prompt_len"), key=lambda x: x[0])):
                gl = gl.sort_values("ratio")
                ax.plot(
                    gl["ratio"],
                    gl["baseline_peak_mem_mib"],
                    "s--",
                    color=f"C{i}",
                    alpha=0.7,
                    label=f"baseline P={plen}",
                )
                ax.plot(gl["ratio"], gl["dedup_peak_mem_mib"], "o-", color=f"C{i}", label=f"dedup P={plen}")
            kind = ", ".join(sorted(set(gp["peak_mem_kind"].astype(str))))
            ax.set_xlabel("prompt dedup ratio")
            ax.set_ylabel(f"peak memory, MiB\n({kind})", fontsize=8)
            ax.set_title(phase.replace("forward_backward", "forward+backward"))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        written.append(_save(fig, title, out_dir / f"memory_{name}.png"))
    return written


def _save(fig, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    replace_atomically(path, lambda f: fig.savefig(f, format="png", dpi=110))  # never through a link
    plt.close(fig)
    return path


# metric -> (value column, p20 column, p80 column, higher is better)
METRICS = {
    "speedup": ("speedup", "speedup_p20", "speedup_p80", True),
    "dedup_ms": ("dedup_ms_p50", "dedup_ms_p20", "dedup_ms_p80", False),
    "baseline_ms": ("baseline_ms_p50", "baseline_ms_p20", "baseline_ms_p80", False),
}


def compare_frames(old, new, metric: str = "speedup", fail_above: float = 0.05):
    """Rows of (case_id, phase, old, new, change, verdict). A regression is a change past
    `fail_above` in the bad direction whose p20-p80 band does not overlap the old one (beyond noise)."""
    col, lo, hi, higher_better = METRICS[metric]
    # Only the columns the verdict reads: merging and iterating every column of 100k-row files
    # was most of `report compare`'s time.
    keep = [*KEY, "status", col, lo, hi]
    old, new = (f[[c for c in keep if c in f.columns]] for f in (old, new))
    merged = old.merge(new, on=KEY, suffixes=("_old", "_new"), how="outer", indicator=True)
    out: list[tuple] = []
    cols = list(merged.columns)
    for values in zip(*(merged[c].tolist() for c in cols)):  # column lists: far faster than rows on 100k
        r = dict(zip(cols, values))
        case, phase = r["case_id"], r["phase"]
        if r["_merge"] == "left_only":
            out.append((case, phase, r[f"{col}_old"], None, None, "missing in new"))
            continue
        if r["_merge"] == "right_only":
            out.append((case, phase, None, r[f"{col}_new"], None, "new case"))
            continue
        so, sn = r["status_old"], r["status_new"]
        if so == "ok" and sn != "ok":
            out.append((case, phase, r[f"{col}_old"], None, None, f"REGRESSION: status {sn}"))
            continue
        if so != "ok" or sn != "ok":
            out.append((case, phase, None, None, None, f"not compared (status {so} -> {sn})"))
            continue
        vo, vn = float(r[f"{col}_old"]), float(r[f"{col}_new"])
        change = vn / vo - 1
        worse = -change if higher_better else change
        lo_o, hi_o = float(r.get(f"{lo}_old", vo)), float(r.get(f"{hi}_old", vo))
        lo_n, hi_n = float(r.get(f"{lo}_new", vn)), float(r.get(f"{hi}_new", vn))
        beyond_noise = hi_n < lo_o if higher_better else lo_n > hi_o
        if worse > fail_above and beyond_noise:
            verdict = "REGRESSION"
        elif worse > fail_above:
            verdict = "worse, within noise"
        elif -worse > fail_above and (lo_n > hi_o if higher_better else hi_n < lo_o):
            verdict = "improved"
        else:
            verdict = "same"
        out.append((case, phase, vo, vn, change, verdict))
    return out


COMPARED = ("REGRESSION", "worse, within noise", "improved", "same")
"""Verdicts of a (case, phase) that was compared (ok in both runs, or ok in OLD and failed in NEW)."""


def compared_count(rows: list[tuple]) -> int:
    """How many rows of compare_frames compared something: a gate that compares nothing fails."""
    return sum(1 for *_, v in rows if v in COMPARED or v.startswith("REGRESSION"))


# What two runs' sidecars must agree on for their times to compare: the machine and the versions
# (environment), the code, and the settings that change what a time means.
RUN_FACTS = {
    "environment": ("platform", "cpu", "python", "torch", "transformers", "cuda", "gpus", "flash_attn", "liger_kernel"),
    "run": ("cpu_count", "git_sha", "git_dirty"),
    "measure": ("warmup", "repeats", "threads"),
}


def _run_facts(path: Path) -> tuple[dict | None, str]:
    """The facts (RUN_FACTS) of the last run recorded in `path`'s sidecar, or (None, why not)."""
    side = sidecar_path(path)
    if not side.exists():
        return None, f"{path} has no sidecar ({side.name}): its machine and versions are unknown"
    try:
        runs = read_sidecar(side)["runs"]
    except ValueError as e:
        return None, f"{e}: the machine and versions of {path} are unknown"
    if not runs or not isinstance(runs[-1], dict):
        return None, f"{side} records no run: the machine and versions of {path} are unknown"
    last = runs[-1]
    facts = {}
    for where, keys in RUN_FACTS.items():
        table = last if where == "run" else last.get(where)
        table = table if isinstance(table, dict) else {}
        for k in keys:
            if k in table:
                facts[k if where != "measure" else f"measure.{k}"] = table[k]
    return facts, ""


def run_differences(old: Path, new: Path) -> list[str]:
    """Notes on how the runs behind two results files differ (machine, versions, code, timing
    settings, from their sidecars), or that a sidecar is missing: times from different machines
    or versions compare only loosely."""
    (fo, why_o), (fn, why_n) = _run_facts(Path(old)), _run_facts(Path(new))
    notes = [w for w in (why_o, why_n) if w]
    if fo is None or fn is None:
        return notes
    for k in dict.fromkeys([*fo, *fn]):
        if k in fo and k in fn and fo[k] != fn[k]:
            notes.append(f"{k}: {fo[k]!r} -> {fn[k]!r}")
    return notes
