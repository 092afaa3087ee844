"""Writing a file the user named, and only that file: never through a symbolic link.

A sweep may run as root, so a link planted where a results file, a sidecar, a lock or a temporary
file would go could make it write any file on the machine. Every such file is opened with
O_NOFOLLOW (a link in the last component is refused with one line naming it; links among the
folders above are the user's own path and are followed), and a file rewritten whole is written
to a temporary file with a random name beside it (created with O_EXCL, so never a file that was
there) and renamed over it: a rename replaces a link itself, never what it points to.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Optional

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class LinkRefused(ValueError):
    """A path zorro would write is a symbolic link."""


def link_refused(path: str | Path, what: str = "") -> LinkRefused:
    """The one-line refusal for `path`, a link (`what`: the role it would play, as "--out")."""
    try:
        where = f" (it points to {os.readlink(path)})"
    except OSError:
        where = ""
    role = f"{what} " if what else ""
    return LinkRefused(
        f"{role}{path} is a symbolic link{where}; zorro writes only regular files, never through a link: "
        "remove the link or name a regular file"
    )


def refuse_link(path: str | Path, what: str = "") -> None:
    """LinkRefused when `path` is a symbolic link (a dangling one included)."""
    if os.path.islink(path):
        raise link_refused(path, what)


def open_no_follow(path: str | Path, flags: int, mode: int = 0o644, what: str = "") -> int:
    """os.open(path, flags) that refuses a link (LinkRefused) and anything but a regular file
    (ValueError): a FIFO or a device is not a results file."""
    try:
        fd = os.open(path, flags | NOFOLLOW | CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.EEXIST and os.path.islink(path)):
            raise link_refused(path, what) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{what + ' ' if what else ''}{path} is not a regular file; zorro writes only regular files")
    os.set_blocking(fd, True)
    return fd


def name_too_long(path: str | Path, what: str = "") -> Optional[str]:
    """Why `path` cannot be created on its file system because of its length (a component
    longer than NAME_MAX bytes, usually 255, or the whole longer than PATH_MAX); None when it can."""
    role = f"{what} " if what else ""
    raw = os.fsencode(path)
    limit = _limit(path, "PC_PATH_MAX", 4096)
    if len(raw) >= limit:
        return f"{role}{short_name(path)}: the path is {len(raw)} bytes, longer than the {limit - 1} this file system takes"
    limit = _limit(path, "PC_NAME_MAX", 255)
    for part in Path(path).parts:
        if len(os.fsencode(part)) > limit:
            return (
                f"{role}{short_name(path)}: the name {short_name(part)} is {len(os.fsencode(part))} bytes, longer than the "
                f"{limit} this file system takes; give a shorter name"
            )
    return None


def _limit(path: str | Path, name: str, default: int) -> int:
    """os.pathconf's `name` of the nearest existing folder above `path`."""
    folder = Path(os.path.abspath(path)).parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError):
        return default


def short_name(text: str | Path) -> str:
    """`text`, its middle cut out when it is long (a name in a one-line message)."""
    text = str(text)
    return text if len(text) <= 60 else f"{text[:28]}...{text[-28:]} ({len(text)} characters)"


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held (blocked, kept pending) inside the block and delivered after it, in the main
    thread: `zorro`'s Ctrl-C handler ends the process at once (zorro_cli.entry), which must not happen
    between a temporary file's creation and its rename or removal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def replace_atomically(path: str | Path, write: Callable[[IO[bytes]], Any], mode: int = 0o644) -> None:
    """Write `path` whole: `write(f)` fills a new temporary file with a random name in the same
    folder (O_EXCL: never an existing file or link), which is then synced and renamed over
    `path`. A kill leaves the old file or the new one; a link at `path` is replaced by the
    regular file, what it pointed to is left alone. The temporary file is removed on failure."""
    path = Path(path)
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):  # a file replaced keeps its permissions (0600 stays 0600)
            mode = stat.S_IMODE(st.st_mode)
    with signals_held():
        _replace(path, write, mode)


def _replace(path: Path, write: Callable[[IO[bytes]], Any], mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:64]}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # mkstemp's 0o600 would hide a results file from its readers
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_bytes_atomically(path: str | Path, data: bytes) -> None:
    """replace_atomically with `data` as the content."""
    replace_atomically(path, lambda f: f.write(data))
