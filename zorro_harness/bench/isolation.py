"""Run a function in a fresh process that cannot outlive the sweep nor take the machine down.

- Processes come from a fork server that has imported torch and transformers once, so a case
  pays for building its model, not for the imports. The server never touches CUDA.
- A result that does not come within the timeout is a status=timeout; a process that dies
  without one is `crashed` (SIGKILL: likely the kernel's OOM killer).
- A watchdog polls the process's resident memory: past `max_memory` bytes beyond what it held
  when it started, or when the machine itself is about to run out (MemAvailable under a
  reserve), the process is killed and the result is status=oom, before the machine swaps or
  freezes.
- Every case process ends as soon as the sweep does (die_with); the fork server then exits
  (its last client is gone), and the resource tracker with them: a killed sweep leaves no
  process computing on.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from zorro_core.distributed.lifetime import children_ignore_sigint, die_with
from zorro_harness.bench.footprint import GIB, available_memory

PRELOAD = ["zorro_harness.bench.runner", "zorro_core.actor.actor"]
"""Modules the fork server imports once (torch, transformers and the dedup path)."""
POLL_S = 0.1
"""How often the watchdog reads the process's memory."""

_CTX: Optional[mp.context.BaseContext] = None


def context() -> Any:  # a multiprocessing context (forkserver, else spawn)
    global _CTX
    if _CTX is None:
        if "forkserver" in mp.get_all_start_methods():
            _CTX = mp.get_context("forkserver")
            _CTX.set_forkserver_preload(PRELOAD)
        else:  # pragma: no cover (macOS/Windows)
            _CTX = mp.get_context("spawn")
    return _CTX


def _start(ctx: Any, proc: Any) -> None:
    """Start `proc` so that it ignores SIGINT (the sweep handles Ctrl-C and ends it). The fork
    server is started first, on its own: its case processes inherit what it ignored when it
    started, and starting a case waits for the server's imports (seconds), during which the
    sweep itself must still see a Ctrl-C."""
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        with children_ignore_sigint():
            forkserver.ensure_running()
        proc.start()
        return
    with children_ignore_sigint():  # pragma: no cover (spawn: macOS/Windows)
        proc.start()


def _entry(target: Callable, sweep_pid: int, *args) -> None:
    """What a case process runs: target(*args), ended with the sweep."""
    die_with(sweep_pid)
    try:
        target(*args)
    except (BrokenPipeError, ConnectionResetError):
        # the sweep stopped listening (Ctrl-C before or while the case ran): there is nobody to tell,
        # and a traceback after the sweep's one line would only confuse; end quietly
        raise SystemExit(1) from None


def rss_of(pid: int) -> Optional[int]:
    """Resident bytes of a process (Linux /proc), None when it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def machine_reserve() -> int:
    """Available memory under which the watchdog stops a case: 5% of the machine, at most 1 GiB."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return GIB // 4
    return min(GIB, total // 20)


@dataclass
class ChildResult:
    """What came back from a case process."""

    status: str
    payload: dict = field(default_factory=dict)
    error: str = ""


def _watch(proc, reader, timeout_s: float, max_memory: Optional[int]) -> Optional[ChildResult]:
    """Wait for a result; a ChildResult when the process had to be stopped (None: one is ready
    or the process ended)."""
    deadline = time.monotonic() + timeout_s
    start_rss = rss_of(proc.pid)
    reserve = machine_reserve()
    while not reader.poll(min(POLL_S, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            return ChildResult("timeout", error=f"no result within {timeout_s:g} s; process killed")
        rss = rss_of(proc.pid)
        if rss is None or not proc.is_alive():
            return None
        start_rss = rss if start_rss is None else min(start_rss, rss)
        if max_memory is not None and rss - start_rss > max_memory:
            return ChildResult(
                "oom",
                error=f"case process grew by {(rss - start_rss) / GIB:.2f} GiB, past --max-memory {max_memory / GIB:.2f} GiB; killed",
            )
        avail = available_memory()
        if avail is not None and avail < reserve:
            return ChildResult(
                "oom",
                error=f"the machine ran out of memory ({avail / 2**20:.0f} MiB available) while the case process "
                f"held {rss / GIB:.2f} GiB; killed before the machine would swap or freeze",
            )
    return None


def run_isolated(target: Callable, args: tuple, timeout_s: float, max_memory: Optional[int] = None) -> ChildResult:
    """Run target(*args, conn) in a fresh process; a timeout, crash, kill or memory blow-up
    becomes the status. `max_memory`: bytes the process may grow by (None: what the machine has)."""
    ctx = context()
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_entry, args=(target, os.getpid(), *args, writer), daemon=True)
    _start(ctx, proc)
    writer.close()
    try:
        stopped = _watch(proc, reader, timeout_s, max_memory)
        if stopped is not None:
            proc.kill()
            proc.join()
            return stopped
        try:
            payload = reader.recv()
        except EOFError:
            proc.join()
            code = proc.exitcode
            why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            if code == -9:
                why += " (likely out of memory: the kernel's OOM killer sends SIGKILL)"
            return ChildResult("crashed", error=f"case process died without a result: {why}")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if "error" in payload and "phases" not in payload:
            return ChildResult(payload.get("status", "error"), payload, payload["error"])
        return ChildResult("ok", payload)
    except BaseException:  # the sweep interrupted (a signal): the case ends now, not when it notices
        proc.kill()
        proc.join()
        raise
    finally:
        reader.close()
