"""One JSON line of millions of token ids, parsed in a few times its size.

`json.loads` turns each id of a line into a Python int (~36 bytes with its list slot, for the 5-7
bytes it takes in the file): a 50 MB line of 8.3M ids peaked near 10x its size. Here a long line's
long integer arrays are cut out of the line's bytes before `json.loads` sees it and parsed by numpy
in chunks, into int32 where the ids fit (int64 otherwise); the rest of the line (its keys, its
short values) goes through `json.loads` as before, with a placeholder string where each array was,
which is then swapped for the array. The result is what `json.loads` gives with each such array
as a numpy array, which is how the reader holds token ids anyway (dataset._compact).

Strings are matched whole by the same scanner, so an array written inside a string value is never
cut out; an array holding anything but integers of at most 18 digits (a float, a huge integer, a
nested list) is left to `json.loads`, and checked as before.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable

import numpy as np

LARGE_LINE_BYTES = 2**20
"""Lines at least this long are parsed here (shorter ones by json.loads alone, as they always were)."""
LONG_ARRAY_BYTES = 2**16
"""Integer arrays at least this long (in the file) are cut out and parsed by numpy."""
CHUNK_BYTES = 2**22
"""Bytes of an array numpy parses at a time (its int64 temporary is about this size)."""

# A whole JSON string (skipped: an array inside one is text), or an array of integers; possessive,
# so that a scan is linear however long the match.
_TOKENS = re.compile(rb'"(?:[^"\\]++|\\.)*+"|\[\s*+-?\d{1,18}+(?:\s*+,\s*+-?\d{1,18}+)*+\s*+\]')
_INT32 = np.iinfo(np.int32)


def loads_large(raw: bytes, loads: Callable[[str], Any]) -> Any:
    """`loads(raw.decode("utf-8"))` with every long integer array as a numpy array (module doc).
    UnicodeDecodeError and `loads`' errors as `loads(raw.decode())` raises them."""
    nonce = os.urandom(8).hex()
    pieces: list[bytes] = []
    arrays: dict[str, np.ndarray] = {}
    last = 0
    for m in _TOKENS.finditer(raw):
        start, end = m.span()
        if raw[start] != ord("[") or end - start < LONG_ARRAY_BYTES:
            continue
        key = f"\0zorro-token-ids-{nonce}-{len(arrays)}"
        arrays[key] = parse_int_array(raw, start + 1, end - 1)
        pieces += [raw[last:start], json.dumps(key).encode()]
        last = end
    if not arrays:
        return loads(raw.decode("utf-8"))
    pieces.append(raw[last:])
    skeleton = b"".join(pieces)
    try:
        text = skeleton.decode("utf-8")
    except UnicodeDecodeError:
        raw.decode("utf-8")  # raises with the byte's place in the line, not in the skeleton
        raise
    return _put_back(loads(text), arrays)


def parse_int_array(raw: bytes, start: int, end: int) -> np.ndarray:
    """The integers of `raw[start:end]` (comma-separated, spaces allowed), parsed CHUNK_BYTES at a
    time into one array: int32 while they fit, else int64."""
    out = np.empty(raw.count(b",", start, end) + 1, dtype=np.int32)
    filled, pos = 0, start
    while pos < end:
        cut = end
        if end - pos > CHUNK_BYTES:
            cut = raw.find(b",", pos + CHUNK_BYTES, end)
            cut = end if cut < 0 else cut
        part = np.fromstring(raw[pos:cut], dtype=np.int64, sep=",")
        if out.dtype == np.int32 and part.size and not (_INT32.min <= part.min() and part.max() <= _INT32.max):
            out = out.astype(np.int64)
        out[filled : filled + part.size] = part
        filled += part.size
        pos = cut + 1
    if filled != out.size:  # the scanner matched what numpy did not read whole: never expected
        raise ValueError(f"an integer array read {filled} of its {out.size} values")
    return out


def _put_back(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, str):
        return arrays.get(obj, obj)
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = _put_back(v, arrays)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            obj[i] = _put_back(v, arrays)
    return obj
