"""`zorro`: benchmark, verify and analyze prompt deduplication for RL post-training."""

from __future__ import annotations

import typer

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


def _register_optional() -> None:
    """Sub-commands live in their own modules; each registers itself on the app."""
    import importlib

    for name in ("bench", "verify", "report", "analyze"):
        try:
            mod = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{name}":
                raise
            continue
        mod.register(app)


_register_optional()

if __name__ == "__main__":
    app()
