"""TableOut (a command's --out): the backup's name checked before any work (issue 60, defect 10), and the
replaced file's permissions kept (a 0600 results file was replaced by a 0644 one)."""

import os
import stat

import pytest

from zorro_harness.bench.files import replace_atomically
from zorro_harness.bench.results import TableOut

COLUMNS = ("a", "b")


def _results(path):
    path.write_text("a,b\n1,2\n")
    return path


def test_a_backup_name_past_the_limit_is_refused_before_any_work(tmp_path):
    """A 249-byte name whose .1.bak-.9.bak exist: the tenth backup (.10.bak) is 256 bytes, over NAME_MAX."""
    out = _results(tmp_path / ("r" * 245 + ".csv"))
    for n in range(1, 10):
        (tmp_path / f"{out.name}.{n}.bak").write_text("a,b\n")
    table = TableOut(out, "--out", "test", COLUMNS)
    with pytest.raises(ValueError, match=r"--out.*backup.*\.10\.bak"):
        table.check()


def test_a_backup_name_within_the_limit_passes_and_is_the_one_written(tmp_path):
    out = _results(tmp_path / ("r" * 240 + ".csv"))
    for n in range(1, 10):
        (tmp_path / f"{out.name}.{n}.bak").write_text("a,b\n")
    table = TableOut(out, "--out", "test", COLUMNS)
    table.check()
    with table:
        table.write([{"a": 3, "b": 4}], COLUMNS)
    assert table.kept == tmp_path / f"{out.name}.10.bak" and table.kept.read_text() == "a,b\n1,2\n"


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_a_replaced_results_file_keeps_its_permissions(tmp_path, mode):
    out = _results(tmp_path / "r.csv")
    os.chmod(out, mode)
    table = TableOut(out, "--out", "test", COLUMNS)
    table.check()
    with table:
        table.write([{"a": 3, "b": 4}], COLUMNS)
        table.write([{"a": 5, "b": 6}], COLUMNS)
    assert stat.S_IMODE(os.stat(out).st_mode) == mode
    plain = tmp_path / "p.txt"
    plain.write_text("x")
    os.chmod(plain, mode)
    replace_atomically(plain, lambda f: f.write(b"y"))
    assert stat.S_IMODE(os.stat(plain).st_mode) == mode and plain.read_text() == "y"
    new = tmp_path / "new.txt"
    replace_atomically(new, lambda f: f.write(b"z"))
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o644
