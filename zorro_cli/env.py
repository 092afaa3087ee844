"""`zorro env`: what this machine can run."""

from __future__ import annotations

import typer
from rich.table import Table

from zorro_cli.console import console, escape, print_json
from zorro_harness.bench.environment import environment


def env(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    info = environment()
    if as_json:
        print_json(info)
        return
    table = Table(title="zorro env")
    table.add_column("item")
    table.add_column("value")
    for k, v in info.items():
        if k == "varlen_backends":
            for name, why in v.items():
                table.add_row(
                    f"varlen backend {name}", "[green]ok[/]" if why == "ok" else f"[yellow]unavailable[/]: {why}"
                )
        elif k == "model_families":
            for name, how in v.items():
                table.add_row(f"family {name}", escape(str(how)))
        else:
            table.add_row(k, escape(str(v)))
    console.print(table)
