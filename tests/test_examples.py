"""The trainer examples run, at a tiny size, and check themselves (`--check`: zorro served every call and
the losses equal the trainer's own). verl's example runs in .ci/verl_e2e, OpenRLHF's in .ci/openrlhf_tests;
examples that need a GPU say so in examples/README.md."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("trl", reason="the TRL examples need the trl extra (pip install -e '.[trl]')")


def _run(args: list[str], tmp: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run an example with its own temporary folder (`tmp`), which it must leave empty."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    res = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith("zorro_"))
    assert left == [], f"the example left {left} in its temporary folder"
    return res


def test_trl_example_checks_itself(tmp_path):
    res = _run([sys.executable, "examples/trl/grpo.py", "--tiny", "--check"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "served by zorro/TRL: {'dedup': 3, 'fallback': 0}" in res.stdout


def test_trl_example_with_accumulation_checks_itself(tmp_path):
    """Two slices per optimizer step: each window one prompt-once step, the losses TRL's."""
    res = _run([sys.executable, "examples/trl/grpo.py", "--tiny", "--accumulation", "2", "--check"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "windows (one prompt-once step each / handed back): {'dedup': 1, 'fallback': 0}" in res.stdout


@pytest.mark.slow
def test_trl_distributed_example_checks_itself(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    res = _run([torchrun, "--nproc-per-node", "2", "examples/trl/grpo_distributed.py", "--tiny", "--check"], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "TRL + zorro, regrouped" in res.stdout


def test_every_example_is_listed_with_how_it_runs():
    """examples/README.md names each example and whether CI runs it or it needs a GPU."""
    listed = (ROOT / "examples" / "README.md").read_text()
    scripts = [
        p.relative_to(ROOT / "examples").as_posix()
        for p in (ROOT / "examples").rglob("*")
        if p.suffix in (".py", ".sh")
    ]
    missing = [s for s in scripts if s not in listed]
    assert not missing, f"examples/README.md does not list {missing}"
