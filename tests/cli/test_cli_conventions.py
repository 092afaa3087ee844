"""The CLI's conventions, over every command: help on every option, one meaning per short
flag, one error style (exit 2 with the reason on stderr, brackets kept), JSON without NaN,
no private name shared between modules."""

import ast
import math
import pathlib

import pytest
import typer
from typer.testing import CliRunner

from zorro_cli.console import error_cell, fail, parameter_cell, print_json
from zorro_cli.main import app

CLI = pathlib.Path(__file__).resolve().parents[2] / "zorro_cli"

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
        "verify distributed",
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


def test_no_private_name_crosses_a_module():
    """A name another module imports is public (console.py holds the shared ones): no `from x import _y`."""
    crossing = [
        f"{path.name}: from {'.' * node.level}{node.module or ''} import {alias.name}"
        for path in sorted(CLI.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not crossing, crossing


def test_shared_cells():
    assert error_cell(None) == error_cell(math.nan) == "-" and error_cell(1.234e-7) == "1.2e-07"
    assert parameter_cell("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert parameter_cell("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_print_json_refuses_a_nan_and_names_the_field(bad, capsys):
    """JSON has no NaN: a report holding one is an error naming where, and nothing is printed."""
    with pytest.raises(ValueError, match=r"results\[1\]\.err"):
        print_json({"ok": 1.0, "results": [{"err": 0.5}, {"err": bad}]})
    assert capsys.readouterr().out == ""
    print_json({"err": None})
    assert capsys.readouterr().out == '{\n  "err": null\n}\n'
