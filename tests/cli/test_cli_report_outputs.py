"""Where `zorro report` writes: never onto one of its inputs (a results file or its sidecar), and a
path that cannot be created is one line and exit 2, not a traceback."""

import pytest
from test_cli_report import row, stack_rows, write
from typer.testing import CliRunner

from zorro_cli.main import app

runner = CliRunner()


def _rows():
    return [row(1, 64, "forward", 2.0), row(4, 64, "forward", 1.5)]


def _refused(args, *words):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    text = " ".join(res.output.split())
    for w in words:
        assert w in text, text
    return text


@pytest.mark.parametrize("command", ["show", "stack"])
def test_csv_onto_an_input_is_refused_and_the_input_kept(tmp_path, command):
    src = write(tmp_path / "r.csv", stack_rows() if command == "stack" else _rows())
    other = write(tmp_path / "o.csv", _rows())
    before = src.read_bytes()
    for target in (src, tmp_path / "sub" / ".." / "r.csv"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        _refused(["report", command, other, src, "--csv", target], "--csv", "r.csv", "input")
        assert src.read_bytes() == before
    link = tmp_path / "hard.csv"
    link.hardlink_to(src)
    _refused(["report", command, src, "--csv", link], "--csv", "input")
    assert src.read_bytes() == before


def test_csv_onto_an_inputs_sidecar_is_refused(tmp_path):
    src = write(tmp_path / "r.csv", _rows())
    side = tmp_path / "r.json"
    side.write_text('{"zorro_sidecar": 1, "runs": []}\n')
    _refused(["report", "show", src, "--csv", side], "--csv", "sidecar")
    assert side.read_text() == '{"zorro_sidecar": 1, "runs": []}\n'


@pytest.mark.parametrize("option", ["--csv", "--plots"])
def test_show_output_that_cannot_be_created_is_one_line(tmp_path, option):
    src = write(tmp_path / "r.csv", _rows())
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    text = _refused(["report", "show", src, option, blocker / "sub" / "out"], option, "cannot")
    assert "a-file" in text


def test_stack_csv_that_cannot_be_created_is_one_line(tmp_path):
    src = write(tmp_path / "r.csv", stack_rows())
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _refused(["report", "stack", src, "--csv", blocker / "t.csv"], "--csv", "cannot")
