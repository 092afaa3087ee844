"""The CLI's one rich Console and its one error style.

Every command prints through `console` (stdout) and fails through `fail` (the reason on
stderr, exit code 2). Text from outside (file names, case ids, error messages that quote
"[measure]") goes through `escape`, which `fail` applies itself: rich would read brackets
as markup and drop them.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

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
    err_console.print(f"[red]error:[/] {escape(str(reason))}")
    raise typer.Exit(code)


def print_json(report: Any) -> None:
    """A command's JSON report on stdout, indented; a NaN or infinity is an error, not invalid JSON."""
    typer.echo(json.dumps(report, indent=2, allow_nan=False))


def warn(text: str) -> None:
    """A plain-text warning on stdout (markup escaped)."""
    console.print(f"[yellow]{escape(str(text))}[/]")


__all__ = ["console", "err_console", "escape", "fail", "print_json", "warn", "EXIT_USAGE"]
