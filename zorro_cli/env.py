"""`zorro env`: what this machine can run."""

from __future__ import annotations

import typer
from rich.table import Table

from zorro_cli.console import console, escape, print_json
from zorro_harness.bench.environment import environment, self_check_probe


def self_check_row(device: str) -> str:
    """The self-check run here (zorro_harness.bench.environment.self_check_probe) and its default, in one line."""
    default = "on by default here" if device == "cuda" else "off by default on CPU (ActorConfig(self_check=True))"
    try:
        verdict = self_check_probe(device)
    except Exception as e:  # noqa: BLE001 - a crash is reported as the row, never hidden
        return f"error: {type(e).__name__}: {e}; {default}"
    return f"{'pass' if verdict.passed else 'FAIL'}: {verdict.describe()}; {verdict.seconds:.1f} s; {default}"


def env(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Versions, devices, backends and families on this machine, and the self-check run here."""
    info = environment()
    info["self_check"] = self_check_row(info["device"])
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
