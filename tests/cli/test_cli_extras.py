"""The install's split: a trainer installs the base (torch, transformers, numpy) and imports
zorro_core; the `zorro` command needs the cli extra, and says so in one line when it is missing."""

import pathlib
import subprocess
import sys

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli comes with the cli extra
    import tomli as tomllib

from zorro_cli.entry import CLI_PACKAGES, INSTALL_HINT

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]


def _name(requirement: str) -> str:
    """The distribution name of a requirement: "tomli>=2; python_version < '3.11'" -> "tomli"."""
    for stop in "<>=!~;[ ":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower()


def run_zorro(prelude: str, *args: str) -> subprocess.CompletedProcess:
    """`zorro ARGS` through the console script's function, after `prelude` (which can hide a package)."""
    code = f"import sys\n{prelude}\nsys.argv = ['zorro', *{list(args)!r}]\nfrom zorro_cli.entry import main\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )


def test_the_base_install_has_no_cli_package_and_the_cli_extra_has_them_all():
    base = {_name(r) for r in PROJECT["dependencies"]}
    extras = PROJECT["optional-dependencies"]
    assert base == {"torch", "transformers", "numpy"}
    assert {_name(r) for r in extras["cli"]} == set(CLI_PACKAGES)
    assert "zorro[cli]" in extras["dev"] and {"pytest", "hypothesis", "ruff", "mypy"} <= {
        _name(r) for r in extras["dev"]
    }
    assert PROJECT["scripts"]["zorro"] == "zorro_cli.entry:main"


@pytest.mark.parametrize("package", ["typer", "pandas"])
def test_zorro_without_the_cli_extra_says_what_to_install_in_one_line(package):
    res = run_zorro(f"sys.modules[{package!r}] = None  # as if not installed", "--help")
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip() == (
        f"error: the zorro command needs the cli extra ({package} is not installed): {INSTALL_HINT}"
    )
    assert "pip install 'zorro[cli]'" in res.stderr and "Traceback" not in res.stderr and res.stdout == ""


def test_a_missing_module_outside_the_cli_extra_is_not_hidden():
    """Only the cli packages get the hint: any other missing module is a real error, with its traceback."""
    res = run_zorro("sys.modules['zorro_harness.analyze.analysis'] = None", "--help")
    assert res.returncode == 1 and "Traceback" in res.stderr and "zorro_harness.analyze.analysis" in res.stderr
    assert INSTALL_HINT not in res.stderr


def test_zorro_with_the_cli_extra_runs():
    res = run_zorro("", "analyze", "-p", "10", "-n", "2", "-r", "3", "--model", "small-qwen3", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"total_tokens": 26' in res.stdout


def test_ctrl_c_while_the_cli_loads_is_one_line(monkeypatch, capsys):
    """Ctrl-C in `zorro`'s first seconds (torch and the CLI importing): one line, exit 130, no traceback."""
    import types

    from zorro_cli import entry

    class Loading(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "zorro_cli.main", Loading("zorro_cli.main"))
    monkeypatch.setattr(entry, "quit_on_sigint", lambda: None)  # not in pytest's own process
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130 and "interrupted by SIGINT" in capsys.readouterr().err
