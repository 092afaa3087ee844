"""SIGINT and SIGTERM as an exception a command catches: it keeps what it finished and says so in one line."""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the sweep (a BaseException: no `except Exception` on the way holds it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted inside the block (its case process is killed on the way
    out, zorro_harness.bench.isolation); the handlers before are put back after."""

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    old = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
