"""The unclear answers: each bad input or fault is a one-line error (exit 2) naming the
cause, no traceback, and nothing already measured is lost. Cases are faked where a sweep is
needed (the `fake` fixture of conftest.py: no model runs)."""

import errno
import os
import pathlib
from pathlib import Path

import pytest
from conftest import SUITE
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench import files, sidecar
from zorro_harness.bench.results import COLUMNS, REQUIRED_COLUMNS, read_rows

runner = CliRunner()


def one_line_error(res, *words: str) -> str:
    """The result is exit 2 with `error: ...` naming every word, and no traceback."""
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "Traceback" not in res.output and "error:" in text, res.output
    for w in words:
        assert w in text, res.output
    return text


# ---------------------------------------------------------------- file-system faults


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def test_a_disk_that_fills_mid_sweep_keeps_every_whole_row(fake, tmp_path, monkeypatch):
    out = tmp_path / "full.csv"
    real = os.write
    calls = {"n": 0}

    def write(fd, data):
        if _fd_path(fd) == str(out):
            calls["n"] += 1
            if calls["n"] == 3:  # header, row 1, then the disk fills inside row 2
                real(fd, bytes(data)[:7])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    res = fake("--out", out)
    monkeypatch.undo()
    one_line_error(res, str(out), "No space left on device", "1 row(s) measured before are kept", "--resume")
    assert out.read_bytes().endswith(b"\n")  # whole or not at all: no cut line
    assert len(read_rows(out)) == 1


def test_a_disk_that_fills_at_the_final_sidecar_update(fake, tmp_path, monkeypatch):
    out = tmp_path / "side.csv"
    seen = {"n": 0}

    def write_bytes_atomically(path, data):
        seen["n"] += 1
        if seen["n"] == 2:  # the end-of-run update: the temporary file fills up

            def fill(f):
                f.write(data[:10])
                raise OSError(errno.ENOSPC, "No space left on device")

            return files.replace_atomically(path, fill)
        return files.write_bytes_atomically(path, data)

    monkeypatch.setattr(sidecar, "write_bytes_atomically", write_bytes_atomically)
    res = fake("--out", out)
    monkeypatch.undo()
    one_line_error(res, "every row is written", "No space left on device")
    assert len(read_rows(out)) == 3 and not list(tmp_path.glob(".side.json.*"))


@pytest.mark.parametrize(
    "fault",
    [
        (errno.EROFS, "Read-only file system"),
        (errno.EACCES, "Permission denied"),
        (errno.EPERM, "Operation not permitted"),
    ],
    ids=["read-only", "no-permission", "immutable"],
)
def test_an_out_that_cannot_be_written(fake, tmp_path, monkeypatch, fault):
    """As root chmod and chattr cannot be relied on here: the kernel's answer is faked."""
    out = tmp_path / "ro" / "x.csv"
    out.parent.mkdir()
    real = os.open

    def opener(path, *a, **k):
        if str(path).startswith(str(out.parent)):
            raise OSError(fault[0], fault[1], str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", opener)
    res = fake("--out", out)
    monkeypatch.undo()
    one_line_error(res, fault[1], "nothing was measured")


def test_an_immutable_results_file_is_not_moved_aside(fake, tmp_path, monkeypatch):
    out = tmp_path / "imm.csv"
    assert fake("--out", out).exit_code == 0
    before = out.read_bytes()

    def replace(self, target):
        raise PermissionError(errno.EPERM, "Operation not permitted", str(self))

    monkeypatch.setattr(pathlib.Path, "replace", replace)
    res = fake("--out", out)
    monkeypatch.undo()
    one_line_error(res, "Operation not permitted", str(out))
    assert out.read_bytes() == before


# ---------------------------------------------------------------- odd results files on --resume


def test_a_csv_with_a_bom_resumes_and_reports(fake, tmp_path):
    out = tmp_path / "bom.csv"
    assert fake("--out", out).exit_code == 0
    out.write_bytes(b"\xef\xbb\xbf" + out.read_bytes())
    res = fake("--out", out, "--resume")
    assert res.exit_code == 0 and "3 case(s) already done" in res.output, res.output
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0


def test_resume_on_a_file_from_an_older_version_is_refused(fake, tmp_path):
    out = tmp_path / "old.csv"
    out.write_text(",".join(REQUIRED_COLUMNS) + "\n")
    before = out.read_text()
    one_line_error(fake("--out", out, "--resume"), "older zorro", "speedup_p20")
    assert out.read_text() == before


def test_resume_with_other_settings_is_refused(fake, tmp_path):
    out = tmp_path / "set.csv"
    assert fake("--out", out).exit_code == 0
    before = out.read_bytes()
    one_line_error(fake("--out", out, "--resume", "--repeats", "5"), "other settings", "measure.repeats 3 -> 5")
    assert out.read_bytes() == before
    assert fake("--out", out, "--resume").exit_code == 0  # the same settings resume
    assert len(read_rows(out)) == 3 and set(COLUMNS) <= set(read_rows(out)[0])


def test_the_suite_text_is_the_suite(fake, tmp_path):
    import json

    out = tmp_path / "t.csv"
    assert fake("--out", out).exit_code == 0
    assert json.loads(Path(out.with_suffix(".json")).read_text())["runs"][0]["suite_text"] == SUITE


# ---------------------------------------------------------------- suites: refused before anything runs


@pytest.mark.parametrize(
    "text, words",
    [
        ("", ["is empty"]),
        ('name = "x"\n', ["defines no case"]),
        ("[defaults]\nnum_unique_prompts = true\n", ["num_unique_prompts must be an integer"]),
        ("[measure]\nrepeats = 2.5\n[defaults]\nbatch_size = 4\n", ["repeats must be an integer"]),
        ('seed = "abc"\n[defaults]\nbatch_size = 4\n', ["seed must be an integer"]),
        ('[measure]\nmemory = "yes"\n[defaults]\nbatch_size = 4\n', ["memory must be true or false"]),
        ("[measure]\nwarmup = true\n[defaults]\nbatch_size = 4\n", ["warmup must be an integer"]),
        ("[defaults]\nprompt_dedup_ratio = nan\n", ["prompt_dedup_ratio must be a number"]),
        ("[actor]\nlogits_memory_budget_mib = inf\n", ["logits_memory_budget_mib must be a finite number > 0"]),
    ],
    ids=["empty", "no-case", "bool-int", "float-int", "str-int", "str-bool", "bool-warmup", "nan-ratio", "inf"],
)
def test_bad_suites_are_refused_before_anything_runs(tmp_path, text, words):
    suite = tmp_path / "bad.toml"
    suite.write_text(text)
    out = tmp_path / "bad.csv"
    one_line_error(runner.invoke(app, ["bench", "sweep", str(suite), "--out", str(out)]), *words)
    assert not out.exists()


def test_phases_as_one_string_is_one_phase(tmp_path):
    from zorro_harness.bench.suite import load_suite

    suite = tmp_path / "p.toml"
    suite.write_text('[measure]\nphases = "forward"\n[defaults]\nbatch_size = 4\n')
    assert load_suite(suite).measure.phases == ("forward",)


@pytest.mark.parametrize("path, words", [("dir", ["is a directory"]), ("/dev/null", ["not a regular file"])])
def test_a_suite_that_is_not_a_file_says_what_it_is(tmp_path, path, words):
    target = str(tmp_path) if path == "dir" else path
    one_line_error(runner.invoke(app, ["bench", "sweep", target]), *words)


# ---------------------------------------------------------------- report


@pytest.mark.parametrize(
    "value, words",
    [("nan", ["impossible value 'nan'", "speedup"]), ("inf", ["impossible value"]), ("fast", ["'fast'", "speedup"])],
)
def test_report_on_non_numbers_in_numeric_columns(tmp_path, value, words):
    from test_cli_report import results, write

    rows = results()
    rows[0]["speedup"] = value
    f = write(tmp_path / "x.csv", rows)
    one_line_error(runner.invoke(app, ["report", str(f)]), *words)


def test_report_plots_pointing_at_a_file(tmp_path):
    from test_cli_report import results, write

    f = write(tmp_path / "x.csv", results())
    one_line_error(runner.invoke(app, ["report", str(f), "--plots", str(f)]), "--plots", "is a file")


def test_report_stack_on_a_csv_that_is_not_a_stack_sweep(tmp_path):
    from test_cli_report import results, write

    f = write(tmp_path / "x.csv", [dict(r, attn_implementation="flash_attention_3") for r in results()])
    one_line_error(
        runner.invoke(app, ["report", "stack", str(f)]),
        "not a stack sweep",
        "baseline: baseline arm of attn_implementation=eager",
        "+split_attention",
    )


@pytest.mark.parametrize("value, words", [("5", ["5%", "0.05"]), ("1", ["give the unit"])])
def test_fail_above_without_a_unit_is_refused(tmp_path, value, words):
    from test_cli_report import results, write

    f = write(tmp_path / "x.csv", results())
    one_line_error(runner.invoke(app, ["report", "compare", str(f), str(f), "--fail-above", value]), *words)
