"""Reading a dataset file's columns: parquet (pyarrow) and JSON lines (`.jsonl`, `.json` with one object a
line), each row's columns kept only where they are analysed.

Errors are `DatasetError` (a ValueError) whose message starts with the file's name.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any, Collection, Optional

import numpy as np

from zorro_harness.analyze.large_lines import LARGE_LINE_BYTES, loads_large

PROMPT_ID_COLUMNS = ("prompt_ids", "prompt_token_ids", "input_ids")
COMPLETION_ID_COLUMNS = ("completion_ids", "response_ids", "completion_token_ids")
PROMPT_COLUMNS = ("prompt", "messages")
COMPLETION_COLUMNS = ("completion", "response")
MAX_LINE_BYTES = 64 * 2**20
"""The longest JSON line read (a row). A line is parsed whole; a line of LARGE_LINE_BYTES or more
has its long token-id arrays parsed by numpy (large_lines): peak memory ~2x the line, not ~10x."""
COLUMNS_READ = frozenset(PROMPT_ID_COLUMNS + COMPLETION_ID_COLUMNS + PROMPT_COLUMNS + COMPLETION_COLUMNS)
"""The columns kept by default when reading (others are only named): memory follows what is analysed."""


class DatasetError(ValueError):
    """A dataset or tokenizer that cannot be analysed; the message names the file and the problem."""


def read_columns(path: str, keep: Optional[Collection[str]] = None) -> tuple[str, dict[str, Any]]:
    """(format, {column: values}) of a parquet or JSON-lines file; DatasetError names what is wrong.

    Every column of the file is named; only those in `keep` (default COLUMNS_READ) hold values, the
    others None. A JSON-lines file's columns are those of any row (a row without one holds None there)."""
    keep = COLUMNS_READ if keep is None else frozenset(keep)
    name = os.path.basename(path)
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DatasetError(f"{path}: a directory, not a data file (.parquet or .jsonl)")
    regular = os.path.isfile(path)
    lower = name.lower()
    if lower.endswith(".parquet"):
        if not regular:
            raise DatasetError(
                f"{path}: parquet is read from a regular file, not a pipe or device (write it to a file)"
            )
        return "parquet", _read_parquet(path, keep)
    if lower.endswith((".jsonl", ".json", ".ndjson")) or not regular:  # a pipe (`<(...)`) is read as JSON lines
        return "jsonl", _read_jsonl(path, keep)
    raise DatasetError(f"{path}: unknown format (expected .parquet or .jsonl)")


def _read_parquet(path: str, keep: frozenset) -> dict[str, Any]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:  # pragma: no cover - pyarrow is in the cli extra
        raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install 'zorro[cli]')") from e
    try:
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in names if c in keep])
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e
    if rows == 0:
        raise DatasetError(f"{path}: empty file (no rows)")
    # Columns stay arrow arrays: token ids are checked and flattened there, text converted when used.
    return {c: (table.column(c) if c in keep else None) for c in names}


def _read_jsonl(path: str, keep: frozenset) -> dict[str, Any]:
    names: dict[str, None] = {}
    kept: dict[str, list] = {}
    rows = 0
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                raise DatasetError(
                    f"{path}: line {n} is over {MAX_LINE_BYTES:,} bytes (one row a line, each at most that)"
                )
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if len(raw) >= LARGE_LINE_BYTES:  # its long id arrays parsed by numpy, not as Python ints
                if not rows and raw.lstrip().startswith(b"["):
                    raise DatasetError(
                        f"{path}: line {n} starts a JSON array; zorro reads JSON lines, one JSON object per line"
                    )
                obj = _json_line(path, n, raw)
            else:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{path}: line {n} is not UTF-8 (byte {e.start + 1}: {e.reason})") from None
                if not line.strip():
                    continue
                if not rows and line.lstrip().startswith("["):
                    raise DatasetError(
                        f"{path}: line {n} starts a JSON array; zorro reads JSON lines, one JSON object per line"
                    )
                obj = _json_line(path, n, line)
            for k, v in obj.items():
                if k not in names:
                    names[k] = None
                if k in keep:
                    col = kept.get(k)
                    if col is None:
                        col = kept[k] = [None] * rows
                    col.append(_compact(v))
            rows += 1
            for col in kept.values():
                if len(col) < rows:
                    col.append(None)
    if not rows:
        raise DatasetError(f"{path}: empty file (no rows)")
    return {k: kept.get(k) for k in names}


def _json_line(path: str, n: int, line: str | bytes) -> dict:
    """Line `n` parsed (bytes: a large line, its long id arrays as numpy arrays: large_lines)."""
    try:
        obj = json.loads(line) if isinstance(line, str) else loads_large(line, json.loads)
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: line {n} is not UTF-8 (byte {e.start + 1}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: line {n} is not JSON ({e.msg})") from None
    except RecursionError:
        raise DatasetError(f"{path}: line {n} is not JSON zorro reads (nested too deep)") from None
    except ValueError as e:  # Python's limit on the digits of an integer
        raise DatasetError(f"{path}: line {n} is not JSON zorro reads ({e})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}: line {n} is not a JSON object")
    return obj


def _compact(v: Any) -> Any:
    """A list of int64-range ints as an int64 array (8 bytes an id instead of a Python int's ~36);
    anything else as it is (checked, with its row, when its column is used)."""
    if isinstance(v, list) and v and set(map(type, v)) == {int} and -(2**63) <= min(v) and max(v) < 2**63:
        return np.array(v, dtype=np.int64)
    return v
