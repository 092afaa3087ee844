"""`zorro`: benchmark, verify and analyze prompt deduplication for RL post-training.

Every command is registered here, explicitly: `env` below, then each sub-command module's
`register(app)` (verify's adds gradients, training and distributed). The console script is
zorro_cli.entry:main, which says what to install when the cli extra is missing.
"""

from __future__ import annotations

import typer

from zorro_cli import analyze, bench, report, verify
from zorro_cli import env as env_cmd

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

for _module in (bench, verify, report, analyze):
    _module.register(app)

if __name__ == "__main__":
    app()
