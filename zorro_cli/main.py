"""`zorro`: benchmark, verify and analyze prompt deduplication for RL post-training."""

from __future__ import annotations

import typer

from . import (
    analyze,
    bench,
    report,
    verify,
    verify_distributed,  # noqa: F401 -- adds `verify distributed` to verify's sub-app
)
from . import env as env_cmd

app = typer.Typer(
    help="Prompt deduplication for RL post-training: measure it, prove it, analyze a workload.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def main() -> None:
    """Prompt deduplication for RL post-training."""


app.command("env", help="Devices, versions, attention backends and model families that work here.")(env_cmd.env)


for _module in (bench, verify, report, analyze):  # each sub-command module registers itself
    _module.register(app)

if __name__ == "__main__":
    app()
