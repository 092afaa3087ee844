"""A deadline with a stack dump, for device checks that may hang: a hang then says where it hung.

A GPU kernel that never returns, or a host sync waiting on one, leaves a device check silent until
an outer `timeout` kills it, and the log then shows nothing of where. `Watchdog(seconds, on_expire)`
around a piece of work: past its deadline faulthandler writes every thread's Python stack (from a C
thread, so a thread holding the GIL in a kernel call does not stop it), then `on_expire()` runs (a
results row saying so) and the process exits EXIT_TIMEOUT. Leaving the block in time cancels both.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

EXIT_TIMEOUT = 124
"""The exit status of a run whose work passed its deadline (as coreutils' timeout)."""

_IMPORTED = time.perf_counter()


def process_age_s() -> float:
    """Seconds since this process started (its imports included), from /proc; the harness's own
    clock where /proc is not there."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


class Watchdog:
    """A deadline for one piece of work: past it, every thread's stack goes to `file`
    (faulthandler, which needs no GIL), then `on_expire()` runs (a row saying so) and the process
    exits EXIT_TIMEOUT. Used as a context manager; leaving it in time cancels both. Nested: an inner
    deadline (one kernel call inside a step) takes faulthandler's one slot while it runs, and the
    outer one's is re-armed with what is left of it when the inner block ends."""

    _active: list["Watchdog"] = []

    def __init__(self, seconds: float, on_expire: Callable[[], None], file: Any = None) -> None:
        self.seconds = max(float(seconds), 0.1)
        self.on_expire = on_expire
        self.file = file if file is not None else sys.stderr
        self._timer: Optional[threading.Timer] = None
        self._until = 0.0

    def __enter__(self) -> "Watchdog":
        self._until = time.monotonic() + self.seconds
        faulthandler.dump_traceback_later(self.seconds, exit=False, file=self.file)
        # a moment after the dump, so the stacks are written before the row and the exit
        self._timer = threading.Timer(self.seconds + 0.5, self._expire)
        self._timer.daemon = True
        self._timer.start()
        Watchdog._active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self._timer is not None:
            self._timer.cancel()
        if self in Watchdog._active:
            Watchdog._active.remove(self)
        if Watchdog._active:
            outer = Watchdog._active[-1]
            left = max(outer._until - time.monotonic(), 0.1)
            faulthandler.dump_traceback_later(left, exit=False, file=outer.file)

    def _expire(self) -> None:
        try:
            self.on_expire()
        finally:
            for f in (sys.stdout, sys.stderr):
                try:
                    f.flush()
                except Exception:  # noqa: BLE001 - exiting anyway
                    pass
            os._exit(EXIT_TIMEOUT)
