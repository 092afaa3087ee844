"""The CLI's conventions, over every command: help on every option, one meaning per short
flag, one error style (exit 2 with the reason on stderr, brackets kept)."""

import pytest
import typer
from typer.testing import CliRunner

from zorro_cli.console import fail
from zorro_cli.main import app

runner = CliRunner()


def _commands(cmd, path: tuple[str, ...] = ()):
    yield path, cmd
    if hasattr(cmd, "commands"):  # a group (typer vendors its own click: duck-typed)
        for name, sub in cmd.commands.items():
            yield from _commands(sub, path + (name,))


def _is_option(param) -> bool:
    return getattr(param, "param_type_name", "") == "option"


COMMANDS = list(_commands(typer.main.get_command(app)))


def test_every_command_is_found():
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {
        "bench sweep",
        "bench run",
        "verify gradients",
        "verify training",
        "report show",
        "report compare",
        "report stack",
        "analyze",
        "env",
    } <= names


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) or "zorro" for p, _ in COMMANDS])
def test_every_option_has_help(path, cmd):
    for p in cmd.params:
        if _is_option(p) and not p.hidden:
            assert (p.help or "").strip(), f"zorro {' '.join(path)} {p.opts[0]} has no help text"


def test_one_meaning_per_short_flag():
    meaning: dict[str, set[str]] = {}
    for _, cmd in COMMANDS:
        for p in cmd.params:
            if _is_option(p):
                longs = [o for o in p.opts if o.startswith("--")]
                for short in (o for o in p.opts + p.secondary_opts if len(o) == 2 and o != "-h"):
                    meaning.setdefault(short, set()).update(longs)
    clashes = {s: m for s, m in meaning.items() if len(m) > 1}
    assert not clashes, f"short flags with several meanings: {clashes}"


def test_fail_is_exit_2_with_the_reason_and_its_brackets():
    demo = typer.Typer()

    @demo.command()
    def cmd() -> None:
        fail("tiny.toml: in [measure]: unknown key 'x'")

    res = runner.invoke(demo, [])
    assert res.exit_code == 2
    assert "error: tiny.toml: in [measure]: unknown key 'x'" in res.output
