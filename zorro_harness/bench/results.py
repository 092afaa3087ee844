"""Result files: one CSV row per case and phase, appended as each finishes (the JSON sidecar beside
it: sidecar.py).

- Whole rows: each row is one line (no newline inside a value), written with one os.write of
  the whole line on an O_APPEND descriptor and fsynced, so a kill at any moment leaves every
  earlier row intact and at most a cut last line, which readers detect: a resumed sweep drops
  it (that row never finished and runs again), a report refuses the file and says so.
- One writer: a sweep holds an exclusive lock (flock on `<json>.lock`, the sidecar's: results
  files that share a sidecar, x.csv and x.tsv, share the lock) for its whole run; a second one
  is refused with the holder's pid and command. The kernel releases the lock when its holder
  dies, however it dies.
- Backups never overwrite: starting a file afresh renames it to the first free
  `<csv>.<n>.bak` (its sidecar to `<json>.<n>.bak`).
- Only a zorro sidecar is rewritten (sidecar.py); any other JSON table of that name is the
  user's, left alone, and the sweep is refused naming it (check_out).
- Never through a link (zorro_harness.bench.files): the CSV, the sidecar and the lock are opened
  with O_NOFOLLOW, and a link where one of them would go is refused with one line naming it.
- `--out` is checked first (check_out): only a regular results file is ever moved aside or
  appended to; a device, a directory, the suite file itself, a file that is not a results CSV,
  or a name whose sidecar would be the file itself (`x.json`) is refused with the reason.
- A write that fails (disk full, read-only) is a ResultsWriteError naming the file and the
  cause; a row is written whole or not at all (a failed append is cut back off).
- Spreadsheet-safe: a text cell starting with = + - @ or a tab (which a spreadsheet would run
  as a formula: a model directory named `=HYPERLINK(...)`) is written with a leading single
  quote, as is one starting with a quote (so that reading back is exact); numbers (-1.5) are
  written as they are. Every reader here removes that quote (from_spreadsheet_cell), so a
  resumed sweep, a report and a compare see the cell as it was.
A resumed sweep skips every (case_id, phase) that already has a finished row. A CSV may hold
several rows of one key (a failed case run again); readers keep the last.
"""

from __future__ import annotations

import csv
import datetime as dt
import fcntl
import io
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from zorro_harness.bench.files import name_too_long, open_no_follow, refuse_link, replace_atomically, short_name
from zorro_harness.bench.sidecar import NotASidecar, ResultsWriteError, read_sidecar, sidecar_path

# What a case runs (the model and the arms' settings): part of the required columns, and the
# start of the report's configuration key (zorro_harness.bench.report.GROUP_COLUMNS).
SETUP_COLUMNS = ["model", "attn_implementation", "split_attention", "logits_mode", "dtype", "device", "batch_size"]
# The required columns, in this order, then the extra ones.
REQUIRED_COLUMNS = [
    "case_id",
    *SETUP_COLUMNS,
    "num_unique_prompts",
    "prompt_len",
    "response_len",
    "prompt_dedup_ratio",
    "token_redundancy",
    "phase",
    "baseline_ms_p50",
    "dedup_ms_p50",
    "baseline_ms_p20",
    "baseline_ms_p80",
    "dedup_ms_p20",
    "dedup_ms_p80",
    "speedup",
    "speedup_err",
    "baseline_tokens_per_s",
    "dedup_tokens_per_s",
    "baseline_peak_mem_mib",
    "dedup_peak_mem_mib",
    "peak_mem_kind",
    "ideal_speedup",
    "efficiency",
    "status",
    "error",
]
EXTRA_COLUMNS = [
    "baseline_kind",
    "dedup_kind",
    "speedup_p20",
    "speedup_p80",
    "n",
    "warmup",
    "repeats",
    "threads",
    "padding",
    "logical_tokens",
    "unique_tokens",
    "baseline_gflops",
    "dedup_gflops",
    "seed",
    "liger",
    "liger_kernels",
    "logits_memory_budget_mib",
    "checkpointing",
    "finished_utc",
    "sharing",
    "shared_prefix_len",
    "min_shared_tokens",
    "weights",
]
# Cases with nproc > 1 (zorro_harness.bench.distributed): per-rank layout and bytes moved by regroup.
DISTRIBUTED_COLUMNS = [
    "nproc",
    "rows_per_rank_before",
    "rows_per_rank_after",
    "prompt_dedup_per_rank_before",
    "prompt_dedup_per_rank_after",
    "regroup_bytes_sent",
    "regroup_metadata_bytes",
    "restore_bytes_per_step",
]
COLUMNS = REQUIRED_COLUMNS + EXTRA_COLUMNS + DISTRIBUTED_COLUMNS

# A row with one of these statuses is done: --resume does not run it again.
DONE_STATUSES = ("ok", "oom")

FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
"""What a spreadsheet reads as the start of a formula (OWASP's list for CSV injection)."""
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|infinity|nan)", re.IGNORECASE)


def spreadsheet_cell(text: str) -> str:
    """`text` as a spreadsheet shows it as text: a leading single quote before a formula start
    (and before a quote, so that from_spreadsheet_cell is exact); a number is left as it is."""
    if text and (text[0] in FORMULA_START or text[0] == "'") and not _NUMBER.fullmatch(text):
        return "'" + text
    return text


def from_spreadsheet_cell(text: str) -> str:
    """The cell spreadsheet_cell was given."""
    if len(text) > 1 and text[0] == "'" and (text[1] in FORMULA_START or text[1] == "'"):
        return text[1:]
    return text


def lock_path(csv_path: str | Path) -> Path:
    """results/x.csv -> results/x.json.lock: the sidecar's lock, so that results files sharing a
    sidecar (x.csv and x.tsv both have x.json) are locked together."""
    side = sidecar_path(csv_path)
    return side.with_name(side.name + ".lock")


class ResultsBusy(ValueError):
    """Another process is writing this results file."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _first_line(path: Path) -> list[str]:
    with path.open("rb") as f:
        head = f.readline(1 << 16)
    return next(csv.reader([head.decode("utf-8-sig", errors="replace")]), [])


def check_out(out: str | Path, mode: str, protect: tuple[str | Path, ...] = ()) -> None:
    """Refuse an `--out` this sweep may not lock, move aside or append to (ValueError with the
    reason): a sidecar that would be the file itself, anything but a regular file (a device, a
    directory, a pipe), or one of `protect` (the suite file). See also check_is_results."""
    out = Path(out)
    side = sidecar_path(out)
    if side == out:
        raise ValueError(
            f"--out {out}: its JSON sidecar would be {side}, the file itself; give the results file a .csv name"
        )
    for p, what in ((out, "--out"), (side, "its sidecar"), (lock_path(out), "its lock")):
        why = name_too_long(p, what)
        if why:
            raise ValueError(f"--out {short_name(out)}: {why}" if p != out else why)
        refuse_link(p, what)
    for p, what in ((out, "--out"), (side, "its sidecar")):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ValueError(f"{what} {p}: cannot read it ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {p} is {_kind(st.st_mode)}, not a results file; --out takes a CSV file path")
    check_sidecar_is_ours(side, out)
    if not out.exists():
        return
    for q in protect:
        if q and Path(q).exists() and os.path.samefile(out, q):
            raise ValueError(f"--out {out} is the suite file itself; write the results to another file")


def check_sidecar_is_ours(side: Path, out: Path) -> None:
    """NotASidecar when `side` is a JSON table that is not a zorro sidecar (no marker, no "runs"
    table): a file of the user's that happens to have the sidecar's name. A damaged file (not
    JSON, not UTF-8, not a table) is left to write_sidecar, which keeps it as a backup."""
    try:
        read_sidecar(side)
    except NotASidecar as e:
        raise NotASidecar(
            f"--out {out}: {e}; it is left alone. Move it away, or write the results to another --out"
        ) from None
    except ValueError:
        pass


def check_is_results(out: str | Path, mode: str) -> None:
    """Refuse to move aside or append to an existing non-empty file whose first line is not a
    results header (checked under the lock: a busy file is refused as busy first)."""
    out = Path(out)
    if out.is_file() and out.stat().st_size and not {"case_id", "phase", "status"} <= set(_first_line(out)):
        verb = "move it aside" if mode == "replace" else "append to it"
        raise ValueError(
            f"--out {out} exists and is not a zorro results CSV (its first line is not a results header); "
            f"refusing to {verb}: write to another file"
        )


class ResultsLock:
    """Exclusive lock on a results file for the duration of a `with` block (a sweep)."""

    def __init__(self, csv_path: str | Path) -> None:
        self.csv_path = Path(csv_path)
        self.path = lock_path(csv_path)
        self.fd: Optional[int] = None

    def __enter__(self) -> "ResultsLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_no_follow(self.path, os.O_RDWR | os.O_CREAT, what="the results lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (
                os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not said who it is yet"
            )
            os.close(fd)
            raise ResultsBusy(
                f"{self.csv_path} is being written by another sweep or benchmark ({holder}); wait for it to finish, "
                "or write to another file with --out"
            ) from None
        me = f"pid {os.getpid()}: {' '.join(sys.argv) or sys.executable}, since {dt.datetime.now().isoformat(timespec='seconds')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # the lock file stays (removing it would race a waiting writer)
            os.close(self.fd)  # closing releases the lock
            self.fd = None


def backup(csv_path: str | Path) -> Path:
    """Move the CSV (and its sidecar) to the first free numbered backup; the backup's path."""
    csv_path = Path(csv_path)
    side = sidecar_path(csv_path)
    n = 1
    while any(os.path.lexists(p.with_name(f"{p.name}.{n}.bak")) for p in (csv_path, side)):
        n += 1
    kept = csv_path.with_name(f"{csv_path.name}.{n}.bak")
    csv_path.replace(kept)
    if os.path.lexists(side):
        side.replace(side.with_name(f"{side.name}.{n}.bak"))
    return kept


def read_results_text(path: str | Path, drop_cut_line: bool = False) -> str:
    """The text of a results CSV. ValueError naming the file when it is missing, a directory,
    empty, not UTF-8 text, or (unless `drop_cut_line`) its last line is cut off."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a results CSV")
    if not path.exists():
        raise ValueError(f"results file {str(path)!r} not found")
    data = path.read_bytes()
    if not data.strip():
        raise ValueError(f"{path} is empty (not a zorro results CSV)")
    if b"\0" in data:
        raise ValueError(f"{path} is binary, not a zorro results CSV")
    try:
        text = data.decode("utf-8-sig")  # a BOM (a spreadsheet's export) is not part of the header
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}): not a zorro results CSV") from None
    if not text.endswith("\n"):
        if not drop_cut_line:
            lines = text.count("\n") + 1
            raise ValueError(
                f"{path} is damaged: its last line (line {lines}) is cut off, as a sweep killed while writing "
                "leaves it; `zorro bench sweep SUITE --out FILE --resume` drops that line and runs its case again"
            )
        text = text[: text.rfind("\n") + 1]
    return text


def check_fields(path: str | Path, text: str) -> None:
    """ValueError naming the file and the line when a row's fields do not match the header (no rows built)."""
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None) or []
    n = len(header)
    seen: set[str] = set()
    for col in header:
        if col in seen:
            raise ValueError(f"{path}: the header names the column {col!r} twice; not a zorro results CSV")
        seen.add(col)
    for row in reader:
        if len(row) != n:
            raise ValueError(
                f"{path} is damaged: line {reader.line_num} has {len(row)} fields where the header has {n}"
            )


def parse_results(path: str | Path, drop_cut_line: bool = False, text: Optional[str] = None) -> list[dict[str, str]]:
    """The rows of a results CSV (see read_results_text; `text`: already read); ValueError naming
    the file and the line when a row's fields do not match the header."""
    text = read_results_text(path, drop_cut_line) if text is None else text
    check_fields(path, text)
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None) or []
    return [dict(zip(header, map(from_spreadsheet_cell, row))) for row in reader]


def _header(path: Path) -> list[str] | None:
    if not path.exists() or path.stat().st_size == 0:
        return None
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            return next(csv.reader(f), None)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start}): not a zorro results CSV") from None


def _drop_partial_line(path: Path) -> None:
    """A process killed mid-write can leave a last line without its newline: drop it (that row
    never finished, so a resumed sweep runs it again) rather than glue the next row onto it."""
    refuse_link(path, "--out")
    if not path.exists() or path.stat().st_size == 0:
        return
    fd = open_no_follow(path, os.O_RDWR, what="--out")
    with os.fdopen(fd, "r+b") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def csv_line(values: Sequence[Any]) -> bytes:
    """One CSV line; newlines inside a value become spaces, so that a line is a row."""
    buf = io.StringIO(newline="")
    csv.writer(buf).writerow(
        ["" if v is None else spreadsheet_cell(str(v).replace("\r", " ").replace("\n", " ")) for v in values]
    )
    return buf.getvalue().encode()


def _write_whole(path: Path, data: bytes) -> None:
    """Append `data` with one write (looping only if the kernel takes less), then fsync; when a
    write fails (a full disk) what was written of `data` is cut back off: whole or not at all.
    ResultsWriteError naming the file and the cause."""
    try:
        fd = open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, what="--out")
    except OSError as e:
        raise ResultsWriteError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        start = os.fstat(fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:  # pragma: no cover -- a cut last line is still detected by readers
                pass
            raise ResultsWriteError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


class ResultWriter:
    """Appends whole rows to a CSV, writing the header first if the file is new. `columns`: the
    file's columns (default the sweep's), `required`: those an existing file must have to be
    appended to (default the sweep's required ones)."""

    def __init__(
        self, path: str | Path, columns: Sequence[str] = COLUMNS, required: Optional[Sequence[str]] = None
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        refuse_link(self.path, "--out")
        if self.path.is_dir():
            raise ValueError(f"{self.path} is a directory, not a results CSV")
        _drop_partial_line(self.path)
        header = _header(self.path)
        columns = list(columns)
        required = REQUIRED_COLUMNS if required is None else list(required)
        if header is not None:
            missing = [c for c in required if c not in header]
            if missing:
                raise ValueError(f"{self.path} exists but lacks the columns {missing}: write to a new file")
            newer = [c for c in columns if c not in header]
            if newer:
                raise ValueError(
                    f"{self.path} was written by an older zorro: it lacks the columns {newer}, which new rows "
                    "would silently leave out; start it afresh (without --resume the old file is kept as a "
                    "backup) or write to another file"
                )
            self.columns = header
        else:
            self.columns = columns
            _write_whole(self.path, csv_line(self.columns))

    def append(self, row: dict[str, Any]) -> None:
        _write_whole(self.path, csv_line([row.get(k, "") for k in self.columns]))


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """Every whole row of a results CSV (a cut last line is left out)."""
    return parse_results(path, drop_cut_line=True)


def done_keys(path: str | Path) -> set[tuple[str, str]]:
    """(case_id, phase) pairs whose last row is finished (status ok or oom); a cut last line is not."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return set()
    last: dict[tuple[str, str], str] = {}
    for r in parse_results(path, drop_cut_line=True):
        last[(r["case_id"], r["phase"])] = r.get("status") or ""
    return {k for k, s in last.items() if s in DONE_STATUSES}


SWEEP_HEADER = frozenset({"case_id", "phase", "status"})
"""Columns every `zorro bench sweep` results file starts with (how another command knows it)."""


def _probe_folder(folder: Path, flag: str) -> None:
    """ValueError when no file can be created in `folder` (read-only, /proc, not ours): found out by
    creating and removing a temporary file, before any work is done."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".zorro.", suffix=".probe")
    except OSError as e:
        raise ValueError(f"{flag}: cannot write in folder {short_name(folder)} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(tmp)


class TableOut:
    """A results file one command writes whole, again after every finished case (`zorro bench
    memory`, benchmarks/*.py): the one writer for them, with the sweep's rules.

    - `check()` before any work: a name too long, a link (at the file or its lock), a folder that
      does not exist or cannot be written, anything but a regular file, a sweep's results file,
      or a file whose header lacks `columns` (not `owner`'s; no `columns`: any other file is
      this command's, a plot) is refused, ValueError
      with one line; `also` names other outputs of the run, which must differ from this one.
    - `with out:` holds the results lock (results.ResultsLock, the sweep's): a sweep or another
      command writing the file is refused as busy, and none can start on it meanwhile.
    - `write(rows, columns)`: the first write keeps an existing file as the first free
      `<name>.<n>.bak` (as results.backup, the file alone); every write replaces the file whole (a temporary file,
      never through a link, renamed over it; mode 0644) with the rows so far.
    """

    def __init__(self, path: str | Path, flag: str, owner: str, columns: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.flag = flag
        self.owner = owner
        self.columns = tuple(columns)
        """Columns the file of `owner` always has (an existing file without them is not its)."""
        self.kept: Optional[Path] = None
        """The backup the first write made, if any."""
        self._lock: Optional[ResultsLock] = None
        self._written = False
        self._mode = 0o644  # the replaced file's permissions, once it is known

    def backup_name(self) -> Path:
        """Where the first write keeps the file it replaces: the next free `<name>.N.bak`."""
        n = 1
        while os.path.lexists(self.path.with_name(f"{self.path.name}.{n}.bak")):
            n += 1
        return self.path.with_name(f"{self.path.name}.{n}.bak")

    def check(self, also: Sequence[Optional[str | Path]] = ()) -> None:
        out, flag = self.path, self.flag
        for p, what in ((out, flag), (lock_path(out), f"{flag}'s lock")):
            why = name_too_long(p, what)
            if why:
                raise ValueError(why)
            refuse_link(p, what)
        # the temporary file is `.<name[:64]>.XXXXXXXX.tmp`: never longer than the name limit allows
        for other in also:
            if other is not None and os.path.abspath(other) == os.path.abspath(out):
                raise ValueError(f"{flag} {short_name(out)} is also named for another output; give each its own file")
        folder = out.parent
        if not folder.is_dir():
            raise ValueError(f"{flag}: folder {short_name(folder)} does not exist")
        try:
            st = os.stat(out)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise ValueError(f"{flag} {short_name(out)}: cannot read it ({e.strerror})") from None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{flag} {short_name(out)} is {_kind(st.st_mode)}; {flag} takes a file path")
        if st is not None:  # the old file is kept under the next free .N.bak: that name must be possible too
            why = name_too_long(self.backup_name(), f"{flag}'s backup of the file it replaces")
            if why:
                raise ValueError(why)
        _probe_folder(folder, flag)
        if st is None or st.st_size == 0:
            return
        header = set(_first_line(out))
        if SWEEP_HEADER <= header:
            raise ValueError(
                f"{flag} {short_name(out)} holds the results of a `zorro bench sweep`; refusing to replace them: "
                "write to another file"
            )
        if self.columns and not set(self.columns) <= header:
            raise ValueError(
                f"{flag} {short_name(out)} exists and is not a results file of {self.owner} (its first line is not "
                "its header); refusing to replace it: write to another file"
            )

    def __enter__(self) -> "TableOut":
        self._lock = ResultsLock(self.path)
        self._lock.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.__exit__(*exc)
            self._lock = None

    def write(self, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> None:
        """The file, replaced whole by `rows` (each under `columns`); ResultsWriteError on failure."""
        data = csv_line(list(columns)) + b"".join(csv_line([r.get(c, "") for c in columns]) for r in rows)
        try:
            if not self._written and os.path.lexists(self.path):
                # the file alone (a JSON of that name is not this command's, unlike a sweep's sidecar)
                self.kept = self.backup_name()
                before = os.lstat(self.path)
                if stat.S_ISREG(before.st_mode):  # the new file keeps the old one's permissions (0600 stays)
                    self._mode = stat.S_IMODE(before.st_mode)
                self.path.replace(self.kept)
            replace_atomically(self.path, lambda f: f.write(data), self._mode)
        except OSError as e:
            raise ResultsWriteError(f"cannot write {short_name(self.path)}: {e.strerror or e}") from None
        self._written = True


_MOVED = ("SIDECAR_MARKER", "SIDECAR_FORMAT", "write_sidecar", "update_last_run")


def __getattr__(name: str) -> Any:
    """The sidecar's writers moved to zorro_harness.bench.sidecar; the old path warns."""
    if name in _MOVED:
        import warnings

        from zorro_harness.bench import sidecar

        warnings.warn(
            f"zorro_harness.bench.results.{name} moved to zorro_harness.bench.sidecar.{name} "
            "(removed after 2027-06-01)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sidecar, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
