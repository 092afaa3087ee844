"""`zorro analyze --data` on one huge JSON line of token ids: the line's long integer arrays are
parsed by numpy (zorro_harness.analyze.large_lines), so that the peak memory above the imports
stays within 3x the line (it was ~10x: a Python int per id), and the rows read are what
json.loads reads (arrays inside strings, floats, huge integers and nested lists untouched)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zorro_harness.analyze import large_lines
from zorro_harness.analyze.readers import read_columns

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

LINES = [
    {"prompt_ids": list(range(3000)), "completion_ids": [5, 6, 7] * 900},
    {"prompt": 'see [1, 2, 3] and "[4,5]" \\ [6]', "prompt_ids": [1, 2, 3] * 1000},
    {"prompt_ids": [1.5] + [2] * 3000, "x": [[1, 2]] * 1000},
    {"prompt_ids": [2**70] + [3] * 3000},
    {"prompt_ids": [-(2**40), 2**40] + [7] * 3000, "nested": {"ids": [9] * 3000}},
    {"prompt_ids": [0] * 3000, "completion_ids": [], "t": "\u00e9\u4e2d" * 100},
]


def _same(a, b) -> None:
    assert type(a) is type(b) or isinstance(a, np.ndarray) or isinstance(b, np.ndarray), (type(a), type(b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert np.asarray(a).tolist() == np.asarray(b).tolist()
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("i", range(len(LINES)))
def test_a_large_line_reads_as_json_loads_reads_it(tmp_path, monkeypatch, i):
    monkeypatch.setattr(large_lines, "LONG_ARRAY_BYTES", 64)
    monkeypatch.setattr(large_lines, "CHUNK_BYTES", 100)  # many chunks per array
    raw = json.dumps(LINES[i]).encode()
    got = large_lines.loads_large(raw, json.loads)
    _same(got, json.loads(raw))
    ids = got["prompt_ids"]
    if all(isinstance(x, int) and abs(x) < 2**31 for x in LINES[i]["prompt_ids"]):
        assert isinstance(ids, np.ndarray) and ids.dtype == np.int32
    # and through the reader, a large line taking this path
    monkeypatch.setattr("zorro_harness.analyze.readers.LARGE_LINE_BYTES", 16)
    path = tmp_path / "d.jsonl"
    path.write_bytes(raw + b"\n" + json.dumps({"prompt_ids": [1, 2]}).encode() + b"\n")
    _, cols = read_columns(str(path))
    assert np.asarray(cols["prompt_ids"][0]).tolist() == LINES[i]["prompt_ids"]


def test_bad_json_in_a_large_line_is_still_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("zorro_harness.analyze.readers.LARGE_LINE_BYTES", 16)
    monkeypatch.setattr(large_lines, "LONG_ARRAY_BYTES", 16)
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt_ids": [' + b"1, " * 100 + b'2], "x": }\n')
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_columns(str(path))
    path.write_bytes(b'{"prompt_ids": [' + b"1, " * 100 + b'2], "t": "\xff"}\n')
    with pytest.raises(ValueError, match="line 1 is not UTF-8"):
        read_columns(str(path))


def _peak_kib(data: Path) -> int:
    """Peak RSS (KiB) of `zorro analyze --data` on `data`, in its own process."""
    cmd = [sys.executable, "-m", "zorro_cli.entry", "analyze", "--data", str(data), "--model", "small-qwen3",
           "-r", "10", "--json"]  # fmt: skip
    probe = (
        "import resource, subprocess, sys\n"
        f"r = subprocess.run({cmd!r}, capture_output=True, text=True)\n"
        "assert r.returncode == 0, r.stderr\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=ENV, cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def _id_line(n: int) -> bytes:
    """A JSON line of `n` four-digit ids (1000-4095) written as json.dumps does ("1234, "): 6 bytes
    an id, the density of the issue's 50 MB line of 8.3M ids."""
    ids = np.random.default_rng(0).integers(1000, 4096, n)
    cells = np.empty((n, 6), dtype=np.uint8)
    for k, div in enumerate((1000, 100, 10, 1)):
        cells[:, k] = ids // div % 10 + ord("0")
    cells[:, 4], cells[:, 5] = ord(","), ord(" ")
    return b'{"prompt_ids": [' + cells.tobytes()[:-2] + b"]}\n"


def test_one_huge_line_peaks_within_three_times_its_size(tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_bytes(_id_line(8_300_000))
    one = tmp_path / "one.jsonl"
    one.write_bytes(_id_line(100))
    line = big.stat().st_size
    above = (_peak_kib(big) - _peak_kib(one)) * 1024
    assert above <= 3 * line, f"peak {above / 2**20:.0f} MiB above one row's, for a {line / 2**20:.0f} MiB line"
