"""Ctrl-C at any moment of a `zorro` command is one line and exit 130 (issue 60, defect 9): SIGINT sent to a
real `zorro` process at several moments of its start (torch, transformers and the CLI importing, where a
KeyboardInterrupt raised inside an import became a RecursionError, an ImportError, a C++ abort or was
swallowed) and of its run. A process that finished before the signal came is not judged."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
CODE = "import sys\nsys.argv = ['zorro', *sys.argv[1:]]\nfrom zorro_cli.entry import main\nsys.exit(main())\n"
"""What the console script runs (pip's wrapper: import main, call it)."""


def _interrupted(args: list[str], after_s: float) -> tuple[bool, int, str]:
    """(whether the signal came before the process ended, its exit code, its stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CODE, *args],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(after_s)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return sent, proc.returncode, err


def _assert_one_line(sent: bool, code: int, err: str) -> None:
    if not sent:
        return
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130, (code, err[-3000:])
    assert len(lines) == 1 and "interrupted by SIGINT" in lines[0], err[-3000:]


@pytest.mark.parametrize("after_s", [0.15, 0.3, 0.45, 0.65, 0.9, 1.4, 2.2])
def test_ctrl_c_while_zorro_env_starts_or_runs(after_s):
    _assert_one_line(*_interrupted(["env"], after_s))


@pytest.mark.parametrize("after_s", [0.3, 0.5, 0.8, 1.5])
def test_ctrl_c_while_bench_memory_starts(after_s):
    sent, code, err = _interrupted(["bench", "memory", "--model", "nope"], after_s)
    if sent and code == 2:  # it had refused the model (one line, exit 2) as the signal came: not an interrupt
        assert "nope" in err and "Traceback" not in err, err
        return
    _assert_one_line(sent, code, err)


def test_a_handler_of_the_command_still_keeps_its_rows(tmp_path):
    """Commands that keep what they finished install their own handler (zorro_cli.signals) over the early one."""
    from zorro_cli import signals

    with signals.stopped_by_signals():
        with pytest.raises(signals.Interrupted):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
