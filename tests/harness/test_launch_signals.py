"""A sweep stopped by SIGINT (Ctrl-C, which the terminal sends to every process of the foreground
group) or SIGTERM (to the sweep alone) says so in one line, with the rows it kept and how to go
on, exits 130 or 143, prints no traceback (nor does the fork server importing its modules, nor a
case process), and leaves no process behind.

The in-process tests fake the cases; the others run real sweeps (a fresh interpreter each; the
SIGTERM one is slow: `pytest -m slow tests/harness/test_launch_signals.py`)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_bench_faults import ENV, LONG_CASE, ROOT, _session

import zorro_harness.bench.sweep as sweep_mod
from zorro_harness.bench.results import read_rows


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_sweep_is_one_line_with_the_rows_kept(fake, tmp_path, monkeypatch, sig, code):
    real = sweep_mod.case_rows
    seen = []

    def case_rows(case, measure, **kw):
        seen.append(case.case_id)
        if len(seen) == 2:
            os.kill(os.getpid(), sig)
        return real(case, measure, **kw)

    monkeypatch.setattr(sweep_mod, "case_rows", case_rows)
    out = tmp_path / "r.csv"
    res = fake("--out", out)
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output
    errors = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, res.output
    line = errors[0]
    assert f"interrupted by {sig.name}" in line and "1 row(s)" in line and "--resume" in line, line
    assert len(read_rows(out)) == 1
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the sweep's handlers are undone
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _start(tmp_path, name: str) -> subprocess.Popen:
    suite = tmp_path / f"{name}.toml"
    suite.write_text(LONG_CASE.replace('name = "long"', f'name = "{name}"'))
    cmd = [sys.executable, "-m", "zorro_cli.main", "bench", "sweep", str(suite), "--out", str(tmp_path / f"{name}.csv")]
    return subprocess.Popen(
        cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _wait_for(proc: subprocess.Popen, what, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = what(_session(proc.pid))
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"not seen within {timeout} s: {_session(proc.pid)}")


def _ends_with_one_line(proc: subprocess.Popen, code: int) -> None:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == code, (proc.returncode, out, err)
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "interrupted by" in lines[0], err
    # Nothing computes on: case processes at once, the fork server once its imports are done.
    deadline = time.monotonic() + 90
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session(proc.pid), f"left running after the sweep ended: {_session(proc.pid)}"


def _case_computing(sweep_pid: int):
    first_seen: dict[int, float] = {}

    def find(procs):
        for p, (pp, _) in procs.items():
            if pp != sweep_pid and pp in procs:  # a grandchild: forked by the fork server
                first_seen.setdefault(p, time.monotonic())
                if time.monotonic() - first_seen[p] > 1.5:
                    return p
        return None

    return find


@pytest.mark.parametrize(
    "to_group",
    [
        pytest.param(True, id="ctrl-c-to-the-group"),
        pytest.param(False, id="sigterm-to-the-sweep", marks=pytest.mark.slow),
    ],
)
def test_a_real_sweep_interrupted_mid_case_says_so_and_leaves_nothing(tmp_path, to_group):
    proc = _start(tmp_path, "sig")
    _wait_for(proc, _case_computing(proc.pid))
    if to_group:
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    _ends_with_one_line(proc, 130 if to_group else 143)


def test_ctrl_c_while_the_fork_server_imports_prints_no_traceback(tmp_path):
    proc = _start(tmp_path, "early")
    _wait_for(proc, lambda procs: [p for p, (pp, cmd) in procs.items() if pp == proc.pid and "forkserver" in cmd])
    time.sleep(0.5)  # the fork server is importing torch and transformers
    os.killpg(proc.pid, signal.SIGINT)
    _ends_with_one_line(proc, 130)


def test_a_case_process_whose_sweep_stopped_listening_ends_without_a_traceback(monkeypatch):
    """Ctrl-C in the second before a sweep forks its case: the sweep has closed its end of the pipe,
    and the case's result (or its error) cannot be sent. The case process ends quietly (SystemExit,
    which multiprocessing ends without printing), not with a BrokenPipeError traceback."""
    import multiprocessing

    from zorro_harness.bench import case_process, isolation

    monkeypatch.setattr(isolation, "die_with", lambda pid: None)
    reader, writer = multiprocessing.Pipe(duplex=False)
    reader.close()

    def case(conn):
        try:
            conn.send({"workload": 1})
        except BaseException as e:  # as case_process's entry points: the error is sent too
            conn.send({"error": str(e)})

    with pytest.raises(SystemExit):
        isolation._entry(case, 0, writer)
    assert callable(case_process.workload_process)
