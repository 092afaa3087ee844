"""What the examples may write or delete: only what the user named or what they made themselves
(examples/verl/cpu_e2e.py's --work folder, marked); bad input is one line, exit 2. Needs no trainer:
every refusal comes before anything runs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "examples" / "verl" / "cpu_e2e.py"


def _e2e(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(E2E), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_cpu_e2e_never_empties_a_folder_it_did_not_make(tmp_path):
    work = tmp_path / "experiments"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    res = _e2e("--work", str(work))
    assert res.returncode == 2 and "was not made by this script" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and (work / "keep.txt").read_text() == "mine"
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    (tmp_path / "link").symlink_to(target)
    res = _e2e("--work", str(tmp_path / "link"))
    assert res.returncode == 2 and "symbolic link" in res.stderr and (target / "keep.txt").exists()


def test_cpu_e2e_prepares_only_its_own_marked_folder(tmp_path):
    sys.path.insert(0, str(E2E.parent))
    try:
        import cpu_e2e
    finally:
        sys.path.remove(str(E2E.parent))
    work = cpu_e2e.prepare_work(tmp_path / "new")
    (work / "model").mkdir()
    assert (work / cpu_e2e.WORK_MARK).is_file()
    again = cpu_e2e.prepare_work(tmp_path / "new")  # its own: emptied, marked again
    assert sorted(p.name for p in again.iterdir()) == [cpu_e2e.WORK_MARK]
    assert "marked with" in " ".join(_e2e("--help").stdout.split())  # --help says what --work holds


def test_cpu_e2e_bad_output_arguments_are_one_line(tmp_path):
    for args, what in (
        (["--replot"], "give both"),
        (["--plot", str(tmp_path / "p.png")], "give --csv too"),
        (["--csv", str(tmp_path / "adir"), "--work", str(tmp_path / "w")], "is a directory"),
    ):
        (tmp_path / "adir").mkdir(exist_ok=True)
        res = _e2e(*args)
        assert res.returncode == 2 and what in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
    assert not (tmp_path / "w").exists()  # refused before the work folder is made
