"""The CLI's one rich Console, its one error style, and what several commands share.

Every command prints through `console` (stdout) and fails through `fail` (the reason on
stderr, exit code 2). Text from outside (file names, case ids, error messages that quote
"[measure]") goes through `escape`, which `fail` applies itself: rich would read brackets
as markup and drop them. The verify commands share `resolve_device` (their --device),
`STATUS_STYLE`, `error_cell` and `parameter_cell`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence

import torch
import typer
from rich.console import Console
from rich.markup import escape

# emoji=False: case ids hold ":mask:", which rich would draw as an emoji. Piped to a file or a
# log, rich would fall back to 80 columns: wide enough instead that tables and case ids stay whole.
console = Console(emoji=False, width=None if sys.stdout.isatty() else 170)
err_console = Console(emoji=False, stderr=True, width=None if sys.stderr.isatty() else 170)

EXIT_USAGE = 2
"""Exit code of a refused input (bad option, bad file, too large for the machine)."""


def fail(reason: str, code: int = EXIT_USAGE) -> NoReturn:
    """Print `error: <reason>` (plain text, markup escaped) on stderr and exit with `code`."""
    err_console.print(f"[red]error:[/] {escape(str(reason))}", soft_wrap=True)  # one line, however long
    raise typer.Exit(code)


def refuse_writing_onto_inputs(option: str, out: Path, inputs: Sequence[Path]) -> None:
    """fail when `out` is (the same file as) one of `inputs` or an input's JSON sidecar: writing
    there would replace what the command reads."""
    from zorro_harness.bench.results import sidecar_path

    if not out.exists():
        return
    for p in inputs:
        for q, what in ((p, "an input of this command"), (sidecar_path(p), f"the sidecar of the input {p}")):
            try:
                same = os.path.samefile(out, q)
            except OSError:
                continue
            if same:
                fail(f"{option} {out} is {what}: writing there would replace it; write to another file")


def check_name(option: str, path: Optional[str | Path]) -> None:
    """fail (one line, exit 2) when `path` is too long a name for its file system, before anything runs."""
    from zorro_harness.bench.files import name_too_long

    why = name_too_long(path, option) if path is not None else None
    if why:
        fail(why)


def write_or_fail(option: str, path: Path, write: Any) -> Any:
    """`write()`'s result; an OSError (a path that cannot be created, a full or read-only disk) is
    one line naming the option and the path, exit 2."""
    try:
        return write()
    except OSError as e:
        where = e.filename if isinstance(e.filename, str) else str(path)
        fail(f"{option} {path}: cannot write {where} ({e.strerror or e})")


def print_json(report: Any) -> None:
    """A command's JSON report on stdout, indented; a NaN or infinity is an error (ValueError
    naming the field), not invalid JSON: nothing is printed then."""
    try:
        text = json.dumps(report, indent=2, allow_nan=False)
    except ValueError as e:
        fields = ", ".join(_non_finite_fields(report)) or "?"
        raise ValueError(f"the JSON report holds a NaN or infinity (at {fields}): {e}") from e
    typer.echo(text)


def _non_finite_fields(obj: Any, path: str = "") -> list[str]:
    """Where `obj` (dicts, lists, numbers) holds a NaN or infinity: "ideal_speedup.attention", "results[2].err"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return [path or "the top"]
    if isinstance(obj, dict):
        return [f for k, v in obj.items() for f in _non_finite_fields(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, (list, tuple)):
        return [f for i, v in enumerate(obj) for f in _non_finite_fields(v, f"{path}[{i}]")]
    return []


def warn(text: str) -> None:
    """A plain-text warning on stdout (markup escaped)."""
    console.print(f"[yellow]{escape(str(text))}[/]")


STATUS_STYLE = {
    "pass": "[green]pass[/]",
    "fail": "[bold red]FAIL[/]",
    "error": "[bold red]ERROR[/]",
    "skip": "[yellow]skip[/]",
}
"""A verdict (pass, fail, error, skip) as the tables print it."""


def error_cell(x: Optional[float]) -> str:
    """An error figure as a table cell: 1.2e-07, or '-' where there is none (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1e}"


def parameter_cell(name: str) -> str:
    """A parameter's name as a table cell, without the CausalLM's leading "model."."""
    return name.removeprefix("model.")


def resolve_device(device: Optional[str]) -> str:
    """The --device option checked: cpu, cuda or cuda:N, cuda only where CUDA is available; None
    is cuda when it is, else cpu."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        fail(f"--device {device!r} is not a device zorro runs on; choose cpu or cuda (cuda:N for one GPU)")
    if kind == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here")
    return device


__all__ = [
    "console",
    "err_console",
    "escape",
    "fail",
    "print_json",
    "refuse_writing_onto_inputs",
    "write_or_fail",
    "check_name",
    "warn",
    "EXIT_USAGE",
    "STATUS_STYLE",
    "error_cell",
    "parameter_cell",
    "resolve_device",
]
