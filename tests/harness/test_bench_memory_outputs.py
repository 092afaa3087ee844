"""`zorro bench memory`'s outputs: checked before the first count, written through the one results-file
writer (results.TableOut: the sweep's lock, another command's file refused, a backup), after each case,
never through a link, and kept on an interrupt; its shapes counted right or refused."""

import csv
import os
import signal
import stat

import pytest
from typer.testing import CliRunner

from zorro_cli import bench_memory
from zorro_cli.main import app
from zorro_harness.bench.memory import PATHS, MemoryCase, MemoryRow, count_case
from zorro_harness.bench.results import ResultsLock

runner = CliRunner()
ARGS = ["bench", "memory", "--model", "tiny-qwen3", "--batch", "4", "--prompt-len", "16", "--response-len", "4"]
ARGS += ["--narrow", "2", "--logits-mode", "memory"]


def _fake_rows(case):
    """Rows linear in the prompt length, without building a model."""
    rows = []
    for i, path in enumerate((*PATHS, "ideal")):
        total = float((i + 1) * case.prompt_len * 1000)
        rows.append(MemoryRow(case, path, case.prompt_len, total / 4, 0.0, total, 1.0 + i / 10, total))
    return rows


@pytest.fixture
def counted(monkeypatch):
    """count_isolated replaced by _fake_rows; the calls it had."""
    calls = []

    def fake(case):
        calls.append(case)
        return _fake_rows(case)

    monkeypatch.setattr(bench_memory, "count_isolated", fake)
    return calls


def _said(res) -> str:
    return " ".join(res.output.split())


def test_every_output_is_checked_before_the_first_count(tmp_path, counted):
    (tmp_path / "adir").mkdir()
    long = tmp_path / ("a" * 300 + ".csv")
    valid_long = tmp_path / ("b" * 250 + ".csv")  # a valid name whose lock (.json.lock) is too long
    same = tmp_path / "x.png"
    cases = {
        "is a directory": ["--out", str(tmp_path / "adir")],
        "cannot write in folder": ["--out", "/proc/x.csv"],
        "longer than": ["--out", str(long)],
        "bytes, longer": ["--out", str(valid_long)],
        "name a .png": ["--plot", str(tmp_path / "p.txt")],
        "also named for another output": ["--out", str(same), "--plot", str(same)],
        "does not exist": ["--out", str(tmp_path / "nowhere" / "m.csv")],
    }
    for what, extra in cases.items():
        res = runner.invoke(app, [*ARGS, *extra])
        assert res.exit_code == 2 and what in _said(res), (what, res.output)
        assert "Traceback" not in res.output
    assert counted == []  # nothing counted for any of them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]  # no temporary file left


def test_plot_is_written_at_the_exact_name_never_through_a_link(tmp_path, counted):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "fig.png").symlink_to(victim)
    res = runner.invoke(app, [*ARGS, "--plot", str(tmp_path / "fig")])  # no suffix: refused, not fig.png
    assert res.exit_code == 2 and "name a .png" in _said(res)
    res = runner.invoke(app, [*ARGS, "--plot", str(tmp_path / "fig.png")])
    assert res.exit_code == 2 and "symbolic link" in _said(res)
    assert victim.read_text() == "precious" and counted == []
    res = runner.invoke(app, [*ARGS, "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("p.png.png")) and not list(tmp_path.glob(".*.tmp"))


def test_another_commands_results_are_never_replaced(tmp_path, counted):
    out = tmp_path / "r.csv"
    # a sweep writing it: busy, refused
    with ResultsLock(out):
        res = runner.invoke(app, [*ARGS, "--out", str(out)])
    assert res.exit_code == 2 and "being written by another sweep" in _said(res) and not out.exists()
    # a sweep's finished results file: refused, untouched
    out.write_text("case_id,model,phase,status\nc,m,forward,ok\n")
    res = runner.invoke(app, [*ARGS, "--out", str(out)])
    assert res.exit_code == 2 and "zorro bench sweep" in _said(res)
    assert out.read_text().startswith("case_id") and counted == []
    # a file that is no results file at all: refused
    other = tmp_path / "notes.csv"
    other.write_text("a,b\n1,2\n")
    res = runner.invoke(app, [*ARGS, "--out", str(other)])
    assert res.exit_code == 2 and "not a results file of" in _said(res) and other.read_text() == "a,b\n1,2\n"
    # its own earlier file: replaced, the old one kept as a backup
    mine = tmp_path / "m.csv"
    assert runner.invoke(app, [*ARGS, "--out", str(mine), "--unique", "1"]).exit_code == 0
    first = mine.read_text()
    assert runner.invoke(app, [*ARGS, "--out", str(mine), "--unique", "2"]).exit_code == 0
    assert (tmp_path / "m.csv.1.bak").read_text() == first and mine.read_text() != first


def test_the_csv_is_readable_by_others(tmp_path, counted):
    old = os.umask(0o022)
    try:
        out = tmp_path / "m.csv"
        assert runner.invoke(app, [*ARGS, "--out", str(out)]).exit_code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_an_interrupt_keeps_the_finished_rows_and_says_so(tmp_path, monkeypatch):
    calls = []

    def fake(case):
        calls.append(case)
        if len(calls) == 3:  # the second case's first count: Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
        return _fake_rows(case)

    monkeypatch.setattr(bench_memory, "count_isolated", fake)
    out = tmp_path / "m.csv"
    res = runner.invoke(app, [*ARGS, "--unique", "1,2", "--out", str(out)])
    assert res.exit_code == 128 + signal.SIGINT and "interrupted by SIGINT" in _said(res), res.output
    assert "Traceback" not in res.output
    rows = list(csv.DictReader(out.open()))
    assert [r["unique"] for r in rows] == ["1"] * 4  # the first case's rows, kept


def test_the_shortest_prompt_is_counted(tmp_path):
    """--prompt-len 2 (the option's minimum): the longest prompt is read off two different lengths."""
    res = runner.invoke(app, [*ARGS, "--prompt-len", "2", "--unique", "1"])
    assert res.exit_code == 0 and "ZeroDivisionError" not in res.output, res.output
    assert runner.invoke(app, [*ARGS, "--gpu-gib", "nan"]).exit_code == 2
    assert runner.invoke(app, [*ARGS, "--gpu-gib", "-5"]).exit_code == 2


def _per_layer(model, **kw):
    return {r.path: r.per_layer for r in count_case(MemoryCase(model, 4, 16, 4, 2, "memory", "float32", **kw))}


def test_a_dense_count_does_not_depend_on_narrow_or_layers():
    """Narrowed and one-layer counts scale back to the full ones (dense: every width narrows)."""
    full = _per_layer("tiny-qwen3", layers=2, narrow=1)
    for kw in ({"layers": 1, "narrow": 1}, {"layers": 2, "narrow": 2}):
        other = _per_layer("tiny-qwen3", **kw)
        for path in full:
            assert other[path] == pytest.approx(full[path], rel=0.02), (kw, path)


@pytest.mark.parametrize(
    "model, extra, what",
    [
        ("tiny-qwen3-moe", ["--narrow", "2"], "not narrowed"),  # MoE: expert widths kept
        ("tiny-deepseek-v3", ["--narrow", "1", "--layers", "1"], "not all of one kind"),  # dense then MoE
        ("tiny-deepseek-v3", ["--narrow", "2", "--layers", "2"], "not narrowed"),  # MLA ranks kept
        ("deepseek-ai/DeepSeek-V3", ["--narrow", "8"], "not narrowed"),
    ],
)
def test_moe_and_mla_shapes_that_would_count_wrong_are_refused(model, extra, what, counted):
    res = runner.invoke(app, ["bench", "memory", "--model", model, "--batch", "4", "--prompt-len", "16", *extra])
    assert res.exit_code == 2 and what in _said(res), res.output
    assert counted == []


def test_the_size_of_the_counts_is_said_before_the_first():
    """Issue 60: `zorro bench memory` gave no size or time estimate before a very large count."""
    from zorro_cli.bench_memory import LARGE_COUNT_TOKENS, size_note

    small = size_note(4, 4, 8, 2, 1, 8)
    assert "4 case(s)" in small and "40 tokens" in small and "many minutes" not in small
    big = size_note(2, 4096, 8192, 1024, 1, 8)
    assert f"{4096 * 9216:,} tokens" in big and "many minutes" in big and str(f"{LARGE_COUNT_TOKENS:,}") in big
