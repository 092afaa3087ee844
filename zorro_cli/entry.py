"""The `zorro` console script.

The command needs the cli extra (typer, rich, pandas, matplotlib, pyarrow; tomli before Python 3.11),
which a trainer that only imports zorro_core does not install. Without it, `zorro` says what
to install in one line and exits 2, instead of a traceback.
"""

from __future__ import annotations

import os
import signal
import sys

CLI_PACKAGES = ("typer", "rich", "pandas", "matplotlib", "pyarrow", "tomli")
"""What the cli extra installs (pyproject.toml's [project.optional-dependencies] cli)."""
INSTALL_HINT = "pip install 'zorro[cli]'"
EXIT_USAGE = 2  # zorro_cli.console's, which cannot be imported without rich
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as the shell reports it


def quit_on_sigint() -> None:
    """Ctrl-C ends the command at once, at any moment, with one line and exit 130. Installed before the first
    heavy import: a KeyboardInterrupt raised inside an import (torch, transformers, numpy) surfaced as a
    RecursionError, an ImportError, a C++ abort or was swallowed. Commands that keep what they finished
    install their own handler over this one while they run (zorro_cli.signals), and writes of result files
    hold the signal until the file is whole (zorro_harness.bench.files)."""
    signal.signal(signal.SIGINT, _quit)


def _quit(signum: int, frame: object) -> None:
    os.write(2, b"interrupted by SIGINT\n")  # no buffered stream: the handler may run inside a print
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    """Run the `zorro` app, or say which cli package is missing and how to install the extra."""
    quit_on_sigint()
    try:
        from zorro_cli.main import app
    except KeyboardInterrupt:  # Ctrl-C while torch and the CLI load (the first seconds): one line, no traceback
        print("interrupted by SIGINT while starting; nothing was run", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except ModuleNotFoundError as e:
        missing = (e.name or "").partition(".")[0]
        if missing not in CLI_PACKAGES:
            raise
        print(
            f"error: the zorro command needs the cli extra ({missing} is not installed): {INSTALL_HINT}",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_USAGE) from None
    app()


if __name__ == "__main__":
    main()
