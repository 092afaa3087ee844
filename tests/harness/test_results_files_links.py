"""A sweep and a report never write through a symbolic link: the results CSV, its sidecar, the lock
and every temporary file are opened without following a link (O_NOFOLLOW; temporary files are
created with a random name beside their target, O_EXCL, then renamed over it). A link where a
results file, a sidecar or a lock would go is refused with one line naming it; `report --csv` onto
a link replaces the link with a regular file and leaves what it pointed to alone."""

import json
from pathlib import Path

import pytest
from test_cli_report import row, write
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.results import ResultsLock, ResultWriter, lock_path
from zorro_harness.bench.sidecar import sidecar_path, write_sidecar
from zorro_harness.bench.suite import Measure, Suite
from zorro_harness.bench.sweep import run_suite

runner = CliRunner()
VICTIM_TEXT = "precious: not zorro's\n"


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "elsewhere" / "victim.txt"
    v.parent.mkdir()
    v.write_text(VICTIM_TEXT)
    return v


def _empty_suite() -> Suite:
    return Suite(name="links", cases=[], measure=Measure(memory=False))


def _results(tmp_path: Path) -> Path:
    d = tmp_path / "s1"
    d.mkdir()
    return d / "r.csv"


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    victim, out = _victim(tmp_path), _results(tmp_path)
    lock_path(out).symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link") as e:
        run_suite(_empty_suite(), out)
    assert str(lock_path(out)) in str(e.value)
    assert victim.read_text() == VICTIM_TEXT
    with pytest.raises(ValueError, match="symbolic link"):
        with ResultsLock(out):
            pass
    assert victim.read_text() == VICTIM_TEXT


def test_the_sidecars_temporary_file_is_never_a_link(tmp_path):
    victim, out = _victim(tmp_path), _results(tmp_path)
    side = sidecar_path(out)
    side.with_name(side.name + ".tmp").symlink_to(victim)
    run_suite(_empty_suite(), out)
    assert victim.read_text() == VICTIM_TEXT
    assert side.is_file() and not side.is_symlink()
    assert json.loads(side.read_text())["runs"]
    # no temporary file is left beside the sidecar
    assert sorted(p.name for p in out.parent.iterdir()) == ["r.csv", "r.json", "r.json.lock", "r.json.tmp"]


def test_a_dangling_out_link_is_refused_and_nothing_is_created_outside(tmp_path):
    out = _results(tmp_path)
    target = tmp_path / "elsewhere" / "made.csv"
    target.parent.mkdir()
    out.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link") as e:
        run_suite(_empty_suite(), out)
    assert str(out) in str(e.value)
    assert not target.exists()
    with pytest.raises(ValueError, match="symbolic link"):
        ResultWriter(out)
    assert not target.exists()


@pytest.mark.parametrize("mode", ["resume", "append", "replace"])
def test_a_results_file_that_is_a_link_is_refused_in_every_mode(tmp_path, mode):
    out = _results(tmp_path)
    real = write(tmp_path / "elsewhere.csv", [row(1, 64, "forward", 2.0)])
    before = real.read_bytes()
    out.symlink_to(real)
    with pytest.raises(ValueError, match="symbolic link"):
        run_suite(_empty_suite(), out, mode=mode)
    assert real.read_bytes() == before
    assert out.is_symlink()


def test_a_sidecar_that_is_a_link_is_refused(tmp_path):
    victim, out = _victim(tmp_path), _results(tmp_path)
    sidecar_path(out).symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link"):
        run_suite(_empty_suite(), out)
    with pytest.raises(ValueError, match="symbolic link"):
        write_sidecar(sidecar_path(out), {"x": 1})
    assert victim.read_text() == VICTIM_TEXT


def test_the_sweep_command_refuses_a_linked_out_in_one_line(tmp_path):
    victim, out = _victim(tmp_path), _results(tmp_path)
    lock_path(out).symlink_to(victim)
    suite = tmp_path / "s.toml"
    suite.write_text(
        'name = "links"\n[defaults]\nmodel = "tiny-qwen3"\nbatch_size = 2\nprompt_len = 8\nresponse_len = 2\n'
    )
    res = runner.invoke(app, ["bench", "sweep", str(suite), "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "symbolic link" in lines[0] and "r.json.lock" in lines[0], res.output
    assert victim.read_text() == VICTIM_TEXT


def test_report_csv_onto_a_link_writes_a_regular_file_and_keeps_the_target(tmp_path):
    victim = _victim(tmp_path)
    src = write(tmp_path / "r.csv", [row(1, 64, "forward", 2.0), row(4, 64, "forward", 1.5)])
    piv = tmp_path / "p.csv"
    piv.symlink_to(victim)
    res = runner.invoke(app, ["report", "show", str(src), "--csv", str(piv)])
    assert res.exit_code == 0, res.output
    assert victim.read_text() == VICTIM_TEXT
    assert piv.is_file() and not piv.is_symlink()
    assert piv.read_text().startswith("model,")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("p.csv")] == ["p.csv"]  # no temporary left
