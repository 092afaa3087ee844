"""What a dataset's column holds (token ids, text or chat messages), checked row by row, and its token
ids as a Ragged: every bad row refused naming the file, the row and the column."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from zorro_harness.analyze.ragged import Ragged
from zorro_harness.analyze.readers import DatasetError


def column_values(col) -> list:
    return col.to_pylist() if hasattr(col, "to_pylist") else list(col)


def pick_column(path: str, columns: dict, given: Optional[str], candidates: Sequence[str], what: str) -> Optional[str]:
    if given is not None:
        if given not in columns:
            raise DatasetError(f"{path}: no column {given!r} (columns: {', '.join(columns)})")
        return given
    return next((c for c in candidates if c in columns), None)


def _is_arrow(col: Any) -> bool:
    return hasattr(col, "type") and hasattr(col, "combine_chunks")


def _arrow_int_lists(col: Any) -> bool:
    import pyarrow as pa

    t = col.type
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _row_kind(v: Any) -> str:
    """What one row's value is: token_ids, text, chat, or a description of what it is instead."""
    if isinstance(v, str):
        return "text"
    if isinstance(v, np.ndarray):
        return "token_ids"
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(m, dict) for m in v):
            return "chat"
        if v and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in v):
            return "token_ids"
        return f"a list of {', '.join(sorted({type(x).__name__ for x in v})) or 'nothing'}"
    return type(v).__name__


def value_kind(path: str, column: str, values: Any) -> str:
    """token_ids, text or chat, from the column's first row (every row is checked by check_rows)."""
    if _is_arrow(values):
        if _arrow_int_lists(values):
            return "token_ids"
        values = values.slice(0, 1).to_pylist()
    v = values[0]
    if v is None:
        raise DatasetError(f"{path}: column {column!r} is empty in row 0")
    kind = _row_kind(v)
    if kind in ("token_ids", "text", "chat"):
        return kind
    if isinstance(v, (list, tuple)) and not v:
        raise DatasetError(f"{path}: column {column!r} row 0 is an empty list")
    raise DatasetError(
        f"{path}: column {column!r} holds neither text, chat messages ({{role, content}}) nor token ids (row 0: {kind})"
    )


def _bad_id(v: list) -> Optional[str]:
    """Why a list is not token ids (its first bad element), or None."""
    for x in v:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            return f"holds {type(x).__name__} {x!r}, not an integer token id"
        if not 0 <= x < 2**63:
            return f"holds token id {int(x)}" + (", negative" if x < 0 else ", beyond int64")
    return None


def check_rows(path: str, column: str, values: list, kind: str) -> None:
    """Every row of `column` holds a `kind` value; else the first row that does not, with what it holds."""
    for i, v in enumerate(values):
        where = f"{path}: row {i} of column {column!r}"
        if v is None:
            missing = sum(x is None for x in values)
            raise DatasetError(f"{path}: column {column!r} is empty in {missing} row(s) (first: row {i})")
        got = _row_kind(v)
        if kind == "token_ids" and isinstance(v, (list, tuple)):
            if not v:
                raise DatasetError(f"{where} is an empty list")
            why = _bad_id(list(v))
            if why:
                raise DatasetError(f"{where} {why}")
        elif kind == "chat" and got == "chat":
            bad = next((m for m in v if "role" not in m or "content" not in m), None)
            if bad is not None:
                raise DatasetError(f"{where} holds a message without role and content ({sorted(bad)})")
        elif got != kind:
            raise DatasetError(f"{where} holds {got}, not {kind.replace('_', ' ')} like row 0")


def ids_column(path: str, column: str, values: Any) -> Ragged:
    """A token-id column as a Ragged, every row checked (integers in [0, 2**63), none empty)."""
    if _is_arrow(values):
        ids = _arrow_ids(path, column, values)
    else:
        check_rows(path, column, values, "token_ids")
        ids = Ragged.from_lists([v if isinstance(v, np.ndarray) else np.asarray(list(v), np.int64) for v in values])
    neg = np.flatnonzero(ids.flat < 0)
    if neg.size:
        row = int(np.searchsorted(ids.offsets, neg[0], side="right")) - 1
        raise DatasetError(f"{path}: row {row} of column {column!r} holds token id {int(ids.flat[neg[0]])}, negative")
    return ids


def _arrow_ids(path: str, column: str, col: Any) -> Ragged:
    """A parquet list<integer> column, checked and flattened in arrow (no Python objects per id)."""
    if not _arrow_int_lists(col):
        raise DatasetError(f"{path}: column {column!r} holds {col.type}, not lists of integer token ids")
    arr = col.combine_chunks()
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise DatasetError(f"{path}: column {column!r} is empty in {arr.null_count} row(s) (first: row {row})")
    offsets = arr.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    values = arr.flatten()
    if values.null_count:
        at = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offsets, at, side="right")) - 1
        raise DatasetError(f"{path}: row {row} of column {column!r} holds a null token id")
    flat = values.to_numpy()
    empty = np.flatnonzero(np.diff(offsets) == 0)
    if empty.size:
        raise DatasetError(f"{path}: row {int(empty[0])} of column {column!r} is an empty list")
    if flat.dtype == np.uint64 and flat.size and int(flat.max()) >= 2**63:
        at = int(np.argmax(flat >= 2**63))
        row = int(np.searchsorted(offsets, at, side="right")) - 1
        raise DatasetError(f"{path}: row {row} of column {column!r} holds token id {int(flat[at])}, beyond int64")
    return Ragged(flat.astype(np.int64), offsets)


def check_vocab(path: str, column: str, ids: Ragged, vocab_size: int) -> None:
    """Refuse a token id >= vocab_size, naming its row and value."""
    over = np.flatnonzero(ids.flat >= vocab_size)
    if over.size:
        row = int(np.searchsorted(ids.offsets, over[0], side="right")) - 1
        raise DatasetError(
            f"{path}: row {row} of column {column!r} holds token id {int(ids.flat[over[0]])}, "
            f"outside the model's vocabulary ({vocab_size} ids)"
        )
