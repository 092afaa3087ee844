"""`zorro report compare` reads both runs' sidecars and says when the runs come from different
machines, versions, code or timing settings (or when a sidecar is missing), before its verdicts."""

import json

from test_cli_report import results, write
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.report import run_differences

runner = CliRunner()


def _sidecar(csv_path, torch_version="2.13.0+cpu", gpus=(), sha="abc", threads=1):
    run = {
        "started_utc": "2026-01-01T00:00:00+00:00",
        "git_sha": sha,
        "git_dirty": False,
        "cpu_count": 2,
        "measure": {"warmup": 1, "repeats": 5, "threads": threads},
        "environment": {"platform": "Linux", "torch": torch_version, "gpus": list(gpus), "python": "3.11.7"},
    }
    csv_path.with_suffix(".json").write_text(json.dumps({"zorro_sidecar": 1, "runs": [run]}))


def test_compare_notes_a_different_machine_and_versions(tmp_path):
    old, new = write(tmp_path / "old.csv", results()), write(tmp_path / "new.csv", results())
    _sidecar(old)
    _sidecar(new, torch_version="2.14.0+cu128", gpus=["NVIDIA H200"], sha="def", threads=0)
    res = runner.invoke(app, ["report", "compare", str(old), str(new)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for fact in ("torch: '2.13.0+cpu' -> '2.14.0+cu128'", "gpus: [] -> ['NVIDIA H200']", "git_sha", "measure.threads"):
        assert fact in text, text
    assert "note: the two runs differ" in text


def test_compare_says_nothing_when_the_runs_agree_and_names_a_missing_sidecar(tmp_path):
    old, new = write(tmp_path / "old.csv", results()), write(tmp_path / "new.csv", results())
    _sidecar(old)
    _sidecar(new)
    assert run_differences(old, new) == []
    res = runner.invoke(app, ["report", "compare", str(old), str(new)])
    assert "differ" not in res.output
    new.with_suffix(".json").unlink()
    (note,) = run_differences(old, new)
    assert "new.csv has no sidecar" in note
