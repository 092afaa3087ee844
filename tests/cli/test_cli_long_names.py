"""A file name longer than the file system takes (`--out`, `--csv`, `--plots`, or the sidecar and
lock names an `--out` implies) is refused before anything runs: exit 2, one line naming the
option and the limit, never an `OSError: File name too long` traceback."""

from pathlib import Path

import pytest
from test_cli_report import row, write
from typer.testing import CliRunner

from zorro_cli.main import app

runner = CliRunner()
SUITE = 'name = "p"\n[measure]\nrepeats = 1\nwarmup = 0\nmemory = false\n[defaults]\nmodel = "tiny-qwen3"\nbatch_size = 2\nprompt_len = 8\nresponse_len = 2\n'


def _one_line(res, *words: str) -> None:
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert "Traceback" not in res.output
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("n", [246, 252, 300])
def test_sweep_refuses_an_out_whose_files_would_have_too_long_a_name(tmp_path, monkeypatch, n):
    monkeypatch.chdir(tmp_path)
    Path("s.toml").write_text(SUITE)
    res = runner.invoke(app, ["bench", "sweep", "s.toml", "--out", "a" * n + ".csv"])
    _one_line(res, "--out", "255")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


def test_bench_run_refuses_a_too_long_out(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["bench", "run", "--model", "tiny-qwen3", "--out", "b" * 300 + ".csv"])
    _one_line(res, "--out")


def test_report_refuses_a_too_long_csv_and_plots(tmp_path):
    src = write(tmp_path / "r.csv", [row(1, 64, "forward", 2.0)])
    _one_line(runner.invoke(app, ["report", "show", str(src), "--csv", str(tmp_path / ("c" * 300 + ".csv"))]), "--csv")
    _one_line(runner.invoke(app, ["report", "show", str(src), "--plots", str(tmp_path / ("d" * 300))]), "--plots")


def test_analyze_refuses_too_long_plots(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5]}\n')
    res = runner.invoke(app, ["analyze", "--data", str(data), "--plots", str(tmp_path / ("e" * 300))])
    _one_line(res, "--plots")
