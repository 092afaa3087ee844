"""Results files under faults: whole rows under kill -9, one writer at a time, backups that never
overwrite, damaged files named and refused."""

import os
import random
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.report import load_results
from zorro_harness.bench.results import COLUMNS, ResultsBusy, ResultsLock, ResultWriter, backup, done_keys, read_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny_suite.toml"
runner = CliRunner()


def _row(i: int, **kw) -> dict:
    r = {c: "" for c in COLUMNS}
    r.update({"case_id": f"case{i}", "phase": "forward", "status": "ok", "speedup": 1.5, **kw})
    return r


def test_a_value_with_newlines_stays_one_line(tmp_path):
    out = tmp_path / "r.csv"
    w = ResultWriter(out)
    w.append(_row(0, error="RuntimeError: first\nsecond\r\nthird"))
    w.append(_row(1))
    assert out.read_text().count("\n") == 3
    assert [r["error"] for r in read_rows(out)] == ["RuntimeError: first second  third", ""]


def _forked(body) -> tuple[int, int]:
    """(pid, read end of a pipe) of a forked child running body(write_fd); it never returns here.
    Forked, not spawned: the child needs no fresh interpreter (imports cost seconds on a loaded machine)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.close(r)
        try:
            body(w)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _write_forever(out: Path):
    def body(ready: int) -> None:
        w = ResultWriter(out)
        os.write(ready, b"ready")
        i = 0
        while True:
            r = {c: "x" * 200 for c in COLUMNS}
            r.update(case_id=f"case{i}", phase="forward", status="ok")
            w.append(r)
            i += 1

    return body


def test_rows_stay_whole_when_the_writer_is_killed_at_random_moments(tmp_path):
    out = tmp_path / "r.csv"
    rng = random.Random(0)
    seen = 0
    for _ in range(20):
        pid, ready = _forked(_write_forever(out))
        assert os.read(ready, 5) == b"ready"
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
        rows = read_rows(out)  # a cut last line (if any) is left out, everything before it whole
        assert len(rows) >= seen
        assert all(set(r) == set(COLUMNS) and r["status"] == "ok" and r["baseline_kind"] == "x" * 200 for r in rows)
        seen = len(rows)
    assert seen > 0


def test_a_report_of_a_file_cut_mid_row_names_it_and_fails(tmp_path):
    out = tmp_path / "cut.csv"
    w = ResultWriter(out)
    w.append(_row(0))
    w.append(_row(1))
    text = out.read_text()
    out.write_text(text[: len(text) - 40])
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 2
    said = " ".join(res.output.split())
    assert str(out) in said and "damaged" in said and "cut off" in said and "nan" not in said
    assert done_keys(out) == {("case0", "forward")}  # --resume drops the cut row and runs it again


def test_a_ragged_row_is_named_with_its_line(tmp_path):
    out = tmp_path / "ragged.csv"
    ResultWriter(out).append(_row(0))
    with out.open("a") as f:
        f.write("case1,forward,ok\n")
    with pytest.raises(ValueError, match=r"ragged.csv is damaged: line 3 has 3 fields"):
        load_results([out])


@pytest.mark.parametrize("content,what", [(b"", "is empty"), (b"\x00\x01\x02\xff" * 10, "is binary"),
                                          (b"case_id,phase\n\xff\xfe,x\n", "is not UTF-8")])  # fmt: skip
def test_empty_and_binary_files_are_named(tmp_path, content, what):
    out = tmp_path / "bad.csv"
    out.write_bytes(content)
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 2 and str(out) in " ".join(res.output.split()) and what in res.output


def test_a_directory_is_a_directory(tmp_path):
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "is a directory" in res.output and "not found" not in res.output
    (tmp_path / "out").mkdir()
    res = runner.invoke(app, ["bench", "sweep", str(TINY), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and "is a directory" in res.output
    assert (tmp_path / "out").is_dir() and not list(tmp_path.glob("*.bak"))  # not moved aside as a "backup"


def test_backups_never_overwrite_an_earlier_backup(tmp_path):
    out = tmp_path / "r.csv"
    side = tmp_path / "r.json"
    for run in range(3):
        out.write_text(f"run {run}\n")
        side.write_text(f'{{"run": {run}}}\n')
        kept = backup(out)
        assert kept.name == f"r.csv.{run + 1}.bak" and not out.exists() and not side.exists()
    for run in range(3):
        assert (tmp_path / f"r.csv.{run + 1}.bak").read_text() == f"run {run}\n"
        assert (tmp_path / f"r.json.{run + 1}.bak").read_text() == f'{{"run": {run}}}\n'


def test_rerunning_a_sweep_keeps_every_earlier_run(tmp_path):
    """The issue's reproduction: a third run without --resume deleted the first run's rows."""
    out = tmp_path / "tiny.csv"
    (tmp_path / "tiny.csv.1.bak").write_text("the first run\n")  # a backup made by an earlier rerun
    second = "case_id,phase,status\nthe,second,run\n"  # a results file (only one is ever moved aside)
    out.write_text(second)
    args = ["bench", "sweep", str(TINY), "--out", str(out), "--filter", "b4u1", "--repeats", "1", "--warmup", "0",
            "--no-memory"]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "tiny.csv.1.bak").read_text() == "the first run\n"
    assert (tmp_path / "tiny.csv.2.bak").read_text() == second
    assert "the old one is now" in res.output and "tiny.csv.2.bak" in " ".join(res.output.split())
    assert [r["status"] for r in read_rows(out)] == ["ok", "ok"]


def _hold_lock(out: Path):
    def body(ready: int) -> None:
        with ResultsLock(out):
            os.write(ready, b"held")
            time.sleep(60)

    return body


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
    out = tmp_path / "tiny.csv"
    out.write_text("keep me\n")
    pid, ready = _forked(_hold_lock(out))
    try:
        assert os.read(ready, 4) == b"held"
        res = runner.invoke(app, ["bench", "sweep", str(TINY), "--out", str(out), "--no-memory"])
        said = " ".join(res.output.split())
        assert res.exit_code == 2 and f"pid {pid}:" in said and "being written by another sweep" in said
        assert out.read_text() == "keep me\n" and not list(tmp_path.glob("*.bak"))  # nothing moved, nothing added
        with pytest.raises(ResultsBusy):  # the same from the library
            with ResultsLock(out):
                pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(ready)
    with ResultsLock(out):  # the kernel released it with its holder
        pass
