"""A child process that ends with the process that started it, however that one ends.

Used by the sweep's case processes (zorro_harness.bench.isolation) and by the ranks a local launch
spawns (zorro_core.distributed.launch): killed with SIGKILL, the parent cannot take its children
with it, so each child watches its parent and ends itself.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

_PR_SET_PDEATHSIG = 1
POLL_S = 0.1
"""How often a child polls its parent where pidfds are missing."""


@contextmanager
def children_ignore_sigint() -> Iterator[None]:
    """Processes started inside the block ignore SIGINT. A terminal's Ctrl-C reaches every process
    of the foreground group: the parent alone handles it (and ends its children), instead of each
    child printing a KeyboardInterrupt traceback from wherever it was (a fork server importing
    torch, a case computing). An ignored signal stays ignored across exec, and Python then
    installs no KeyboardInterrupt handler. The parent also blocks it while it starts them, so a
    Ctrl-C in those milliseconds waits (a blocked signal is kept pending, not discarded, though its
    disposition is "ignore") and reaches the parent's own handler after; outside the main thread
    nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def die_with(sweep_pid: int) -> None:
    """In a case process: end as soon as the sweep `sweep_pid` ends, however it ends.

    The fork server cannot do it: each process it forks holds the fork server's "alive" pipe, so
    the server waits for its children while they compute on. So a thread waits on the sweep's
    pidfd (readable when it exits; polled where pidfds are missing) and ends this process; and
    the kernel ends it with the fork server (PR_SET_PDEATHSIG), should that go first."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover (not Linux)
        pass
    threading.Thread(target=_end_with, args=(sweep_pid,), name="end-with-sweep", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _end_with(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    else:  # pragma: no cover (kernels before 5.3)
        while _alive(pid):
            time.sleep(POLL_S)
    os._exit(1)
