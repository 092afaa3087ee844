"""scripts/gpu_check.sh on a machine without CUDA: the headline step first, its CPU stand-in's row
written straight into $OUT, the step's output packed into $OUT as it ends, the log beside it."""

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from zorro_harness.bench.results import read_rows

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_default_order_puts_the_headline_and_the_region_calls_first():
    text = SCRIPT.read_text()
    default = re.search(r'STEPS=" \$\{GPU_CHECK_STEPS:-([^}]*)\} "', text)
    assert default is not None and default.group(1).split() == ["h", "r", "1", "2", "3", "4", "5", "6", "0"]
    # the steps run in that order in the script too
    at = [text.index(f"if want {s}; then") for s in ("h", "r", "1", "2", "3", "4", "5", "6")]
    assert at == sorted(at)


def test_headline_step_writes_into_out_as_it_goes(tmp_path):
    out, res = tmp_path / "out", tmp_path / "res"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OUT": str(out), "RES": str(res),
           "PYTHON": sys.executable, "GPU_CHECK_STEPS": "h", "GPU_TIME_CASES": "b16u1p64r8:split"}  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = read_rows(out / "gpu_time.csv")
    assert [(r["case_id"], r["status"]) for r in rows] == [("b16u1p64r8:split", "ok")]
    with tarfile.open(out / "gpu_results.tgz") as tgz:
        assert {"./gpu_time.csv", "./gpu_time.txt"} <= set(tgz.getnames())
    log = (out / "gpu_check.log").read_text()
    assert "== h. the headline timing" in log and "no CUDA device here" in log and "gpu_time exit code: 0" in log
