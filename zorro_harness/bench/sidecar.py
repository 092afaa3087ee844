"""The JSON sidecar of a results file (results/x.csv -> results/x.json): one record per sweep run.

- Only a zorro sidecar is rewritten: it carries the field `zorro_sidecar` (one written before
  that field existed has a "runs" table); any other JSON table of that name is the user's, left
  alone (NotASidecar), and the sweep is refused naming it (results.check_out).
- It is replaced atomically (written to a temporary file with a random name beside it, created
  with O_EXCL, then renamed; the temporary file is removed when the write fails), never through a
  link. A damaged sidecar (not JSON, not UTF-8, not a {"runs": [...]} table) is kept as a
  numbered backup before a new one is started, and the caller is told.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from zorro_harness.bench.files import refuse_link, write_bytes_atomically

SIDECAR_MARKER = "zorro_sidecar"
"""The field that makes a JSON file a zorro sidecar (its value: the format's version, 1). A sidecar
written before the marker existed is recognised by its "runs" table."""
SIDECAR_FORMAT = 1


def sidecar_path(csv_path: str | Path) -> Path:
    """results/x.csv -> results/x.json."""
    return Path(csv_path).with_suffix(".json")


class ResultsWriteError(ValueError):
    """A results file or its sidecar could not be written (the message names the file and the cause)."""


class NotASidecar(ValueError):
    """A JSON file where a sidecar would go that is not a zorro sidecar: it is never touched."""


def _write_json(path: Path, data: Any) -> None:
    """Replace `path` atomically: a kill leaves the old file or the new one, never half of one.
    A link at `path` is refused (a rename would replace the link, but the sidecar the user
    pointed at would silently stop being the one written)."""
    refuse_link(path, "the sidecar")
    try:
        write_bytes_atomically(path, (json.dumps(data, indent=2, default=str) + "\n").encode())
    except OSError as e:
        raise ResultsWriteError(f"cannot write {path}: {e.strerror or e}") from None


def read_sidecar(path: str | Path) -> dict[str, Any]:
    """The sidecar's table ({"runs": [...]}); ValueError naming the file and what is wrong with it
    when it is not UTF-8, not JSON, or not such a table. A missing file is an empty table."""
    path = Path(path)
    if not path.exists():
        return {"runs": []}
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"sidecar {path} is not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"sidecar {path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    if isinstance(data, dict) and SIDECAR_MARKER not in data and "runs" not in data:
        raise NotASidecar(
            f'{path} is a JSON file but not a zorro sidecar (it has neither a "{SIDECAR_MARKER}" field nor a "runs" table)'
        )
    if not isinstance(data, dict) or not isinstance(data.get("runs", []), list):
        raise ValueError(f'sidecar {path} is not a zorro sidecar (a JSON table with a "runs" list)')
    data.setdefault("runs", [])
    return data


def write_sidecar(path: str | Path, run: dict[str, Any]) -> tuple[Optional[Path], str]:
    """Add one run's record to the sidecar (a resumed sweep adds a second record). A damaged
    sidecar is first moved to the first free `<json>.<n>.bak` (never lost): (that backup, why it
    was damaged); (None, "") otherwise."""
    path = Path(path)
    refuse_link(path, "the sidecar")
    kept, why = None, ""
    try:
        data = read_sidecar(path)
    except NotASidecar:
        raise
    except ValueError as e:
        why = str(e)
        n = 1
        while os.path.lexists(path.with_name(f"{path.name}.{n}.bak")):
            n += 1
        kept = path.with_name(f"{path.name}.{n}.bak")
        try:
            path.replace(kept)
        except OSError as err:
            raise ResultsWriteError(f"cannot move the damaged sidecar {path} aside: {err.strerror or err}") from None
        data = {"runs": []}
    data["runs"].append(run)
    _write_json(path, {SIDECAR_MARKER: SIDECAR_FORMAT, **data})
    return kept, why


def update_last_run(path: str | Path, **fields: Any) -> None:
    """Record facts known only at the end of the run (finish time, load)."""
    path = Path(path)
    if not path.exists():
        return
    data = read_sidecar(path)
    if data["runs"]:
        data["runs"][-1].update(fields)
        _write_json(path, data)
