"""Result files: one CSV row per case and phase, appended as each finishes, and a JSON sidecar.

A killed sweep loses nothing (each row is flushed and fsynced), and a resumed one skips every
(case_id, phase) that already has a finished row. A CSV may hold several rows of one key (a
failed case run again); readers keep the last.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Iterable

# The required columns, in this order, then the extra ones.
REQUIRED_COLUMNS = [
    "case_id", "model", "attn_implementation", "split_attention", "logits_mode", "dtype", "device", "batch_size",
    "num_unique_prompts", "prompt_len", "response_len", "prompt_dedup_ratio", "token_redundancy", "phase",
    "baseline_ms_p50", "dedup_ms_p50", "baseline_ms_p20", "baseline_ms_p80", "dedup_ms_p20", "dedup_ms_p80",
    "speedup", "speedup_err", "baseline_tokens_per_s", "dedup_tokens_per_s", "baseline_peak_mem_mib",
    "dedup_peak_mem_mib", "peak_mem_kind", "ideal_speedup", "efficiency", "status", "error",
]
EXTRA_COLUMNS = [
    "baseline_kind", "dedup_kind", "speedup_p20", "speedup_p80", "n", "warmup", "repeats", "threads", "padding",
    "logical_tokens", "unique_tokens", "baseline_gflops", "dedup_gflops", "seed", "liger", "liger_kernels", "logits_memory_budget_mib", "finished_utc",
    "sharing", "shared_prefix_len", "min_shared_tokens",
]
COLUMNS = REQUIRED_COLUMNS + EXTRA_COLUMNS

# A row with one of these statuses is done: --resume does not run it again.
DONE_STATUSES = ("ok", "oom")


def sidecar_path(csv_path: str | Path) -> Path:
    """results/x.csv -> results/x.json."""
    return Path(csv_path).with_suffix(".json")


def _header(path: Path) -> list[str] | None:
    if not path.exists() or path.stat().st_size == 0:
        return None
    with path.open(newline="") as f:
        return next(csv.reader(f), None)


def _drop_partial_line(path: Path) -> None:
    """A process killed mid-write can leave a last line without its newline: drop it (that row
    never finished, so a resumed sweep runs it again) rather than glue the next row onto it."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    with path.open("r+b") as f:
        f.truncate(cut)


class ResultWriter:
    """Appends rows to a CSV, writing the header first if the file is new."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_line(self.path)
        header = _header(self.path)
        if header is not None:
            missing = [c for c in REQUIRED_COLUMNS if c not in header]
            if missing:
                raise ValueError(f"{self.path} exists but lacks the columns {missing}: write to a new file")
            self.columns = header
        else:
            self.columns = COLUMNS
            with self.path.open("w", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writeheader()

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore").writerow(
                {k: ("" if row.get(k) is None else row.get(k, "")) for k in self.columns})
            f.flush()
            os.fsync(f.fileno())


def read_rows(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def done_keys(path: str | Path) -> set[tuple[str, str]]:
    """(case_id, phase) pairs whose last row is finished (status ok or oom)."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return set()
    last: dict[tuple[str, str], str] = {}
    data = path.read_text()
    lines = data.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):  # a row cut off by a kill is not done
        lines = lines[:-1]
    for r in csv.DictReader(lines):
        last[(r["case_id"], r["phase"])] = r.get("status") or ""
    return {k for k, s in last.items() if s in DONE_STATUSES}


def write_sidecar(path: str | Path, run: dict[str, Any]) -> None:
    """Add one run's record to the sidecar (a resumed sweep adds a second record)."""
    path = Path(path)
    data: dict[str, Any] = {"runs": []}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            data = {"runs": []}
    data.setdefault("runs", []).append(run)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def update_last_run(path: str | Path, **fields: Any) -> None:
    """Record facts known only at the end of the run (finish time, load)."""
    path = Path(path)
    if not path.exists():
        return
    data = json.loads(path.read_text())
    if data.get("runs"):
        data["runs"][-1].update(fields)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def rows_from(paths: Iterable[str | Path]) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for p in paths:
        rows.extend(read_rows(p))
    return rows
