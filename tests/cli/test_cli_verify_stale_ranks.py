"""`zorro verify distributed` with torchrun's rank variables left in the environment (exported in a
shell, not set by torchrun): it says so at once, waits only --join-timeout for the ranks they name,
and then fails in one line naming the variables (exit 2), instead of waiting 300 s in silence."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stale_rank_variables_are_named_and_the_wait_is_bounded():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(
        RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    start = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "zorro_cli.entry", "verify", "distributed", "--device", "cpu", "--join-timeout", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    took = time.monotonic() - start
    err = " ".join(res.stderr.split())
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "not by torchrun" in err and "WORLD_SIZE=2" in err and "unset" in err, err
    assert "could not join" in err and "within 3 s" in err, err
    assert "Traceback" not in res.stderr
    assert took < 90, took
