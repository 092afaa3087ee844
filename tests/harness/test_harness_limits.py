"""The harness at its limits: models and ranks that cannot fit this machine, --out paths that must not be
written, damaged sidecars, reports that compare nothing or hold impossible values, options that are not
finite numbers. Bad inputs answered with a one-line error (exit 2) are in test_cli_bad_inputs.py."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench import guard
from zorro_harness.bench.distributed import distributed_case_rows
from zorro_harness.bench.runner import case_base_row
from zorro_harness.bench.suite import Case, Measure

runner = CliRunner()


def _refused(args: list[str], *words: str) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    for w in words:
        assert w in res.output, res.output
    return res.output


# ---------------------------------------------------------------- 3: verify has a memory guard


@pytest.mark.parametrize("command", ["gradients", "training"])
def test_verify_refuses_a_model_that_cannot_fit(command):
    _refused(["verify", command, "--models", "Qwen/Qwen3-8B", "--dtype", "float64"], "Qwen/Qwen3-8B", "needs at least")


def test_verify_guard_passes_tiny_models_and_names_the_largest():
    assert guard.verify_too_large(["tiny-qwen3", "tiny-llama"]) is None
    why = guard.verify_too_large(["tiny-qwen3", "Qwen/Qwen3-32B"], available=2**34)
    assert "Qwen/Qwen3-32B" in why and "16 GiB" in why


# ---------------------------------------------------------------- 4: ranks capped by cores and memory


def test_verify_distributed_and_bench_run_refuse_more_ranks_than_cores():
    _refused(["verify", "distributed", "--nproc", "64"], "--nproc 64", "CPU core")
    _refused(["bench", "run", "--model", "tiny-qwen3", "--nproc", "64"], "--nproc 64", "CPU core")


def test_ranks_are_capped_by_memory():
    why = guard.ranks_over_memory(8, "tiny-qwen3", available=2**30)
    assert "use at most 3" in why and "8 ranks" in why
    assert guard.ranks_over_memory(2, "tiny-qwen3", available=2**34) is None


def test_a_sweep_case_with_more_ranks_than_cores_is_a_skipped_row():
    case = Case(model="tiny-qwen3", batch_size=128, num_unique_prompts=2, prompt_len=8, response_len=2, nproc=64)
    measure = Measure(repeats=1, warmup=0, memory=False, phases=("forward",))
    (row,) = distributed_case_rows(case, measure, case_base_row(case, measure))
    assert row["status"] == "skipped" and "CPU core" in row["error"]


# ---------------------------------------------------------------- results files (`fake`: conftest.py, no model runs)


def test_out_a_device_is_refused_not_renamed(fake, tmp_path):
    """Defect 1: replace mode 'backed up' /dev/null by renaming it."""
    out = _refused(["bench", "sweep", str(fake.suite), "--out", "/dev/null"], "/dev/null", "character device")
    assert "not a results file" in out
    assert Path("/dev/null").is_char_device() and not list(Path("/dev").glob("null.*.bak"))


def test_out_the_suite_file_itself_is_refused(fake):
    """Defect 1: `bench sweep s.toml --out s.toml` moved the suite away."""
    before = fake.suite.read_text()
    res = fake("--out", fake.suite)
    assert res.exit_code == 2 and "suite file itself" in res.output, res.output
    assert fake.suite.read_text() == before and not list(fake.suite.parent.glob("*.bak"))


def test_out_a_file_that_is_not_results_is_not_moved_aside(fake, tmp_path):
    notes = tmp_path / "notes.csv"
    notes.write_text("my,own\nnotes,here\n")
    res = fake("--out", notes)
    assert res.exit_code == 2 and "not a zorro results CSV" in res.output, res.output
    assert notes.read_text() == "my,own\nnotes,here\n" and not list(tmp_path.glob("*.bak"))


def test_out_whose_sidecar_is_itself_is_refused(fake, tmp_path):
    """Defect 6: `--out X.json` had the sidecar overwrite the CSV."""
    res = fake("--out", tmp_path / "x.json")
    assert res.exit_code == 2 and "sidecar" in res.output and ".csv" in res.output, res.output
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b"\xff\xfe{}", b'{"runs": 3}'])
def test_a_damaged_sidecar_is_kept_as_a_backup_on_resume(fake, tmp_path, damage):
    """Defect 8 (and the unclear answers: a sidecar that is a JSON list or not UTF-8): the earlier
    run records were replaced silently."""
    out = tmp_path / "r.csv"
    assert fake("--out", out).exit_code == 0
    side = out.with_suffix(".json")
    side.write_bytes(damage)
    res = fake("--out", out, "--resume")
    assert res.exit_code == 0, res.output
    kept = side.with_name("r.json.1.bak")
    assert kept.read_bytes() == damage
    assert str(side) in res.output and "r.json.1.bak" in " ".join(res.output.split())
    assert len(json.loads(side.read_text())["runs"]) == 1


# ---------------------------------------------------------------- 5, 11: report compare and impossible values


def test_compare_that_compares_nothing_fails(tmp_path):
    """Defect 5: exit 0 ("no regression") when the files share no case, or NEW has no rows."""
    from test_cli_report import results, row, write

    old = write(tmp_path / "old.csv", results())
    empty = write(tmp_path / "empty.csv", [])
    other = write(tmp_path / "other.csv", [row(3, 64, "forward", 2.0)])
    _refused(["report", "compare", str(old), str(empty)], "nothing compared", "has none of its rows")
    _refused(["report", "compare", str(old), str(other)], "nothing compared")


def test_compare_on_many_rows_is_summarised(tmp_path):
    from test_cli_report import row, write

    rows = [row(1, 128, "forward", 2.0, case_id=f"c{i}") for i in range(300)]
    old = write(tmp_path / "old.csv", rows)
    new_rows = [dict(r) for r in rows]
    new_rows[7] = row(1, 128, "forward", 1.0, case_id="c7")
    new = write(tmp_path / "new.csv", new_rows)
    res = runner.invoke(app, ["report", "compare", str(old), str(new)])
    assert res.exit_code == 1, res.output
    assert "300 (case, phase) rows: 1 REGRESSION, 299 same" in " ".join(res.output.split())
    assert res.output.count("c1") < 5  # the 'same' rows are not printed


@pytest.mark.parametrize(
    "column, value",
    [("baseline_ms_p50", -5.0), ("dedup_ms_p50", 0.0), ("speedup", -1.5), ("speedup_err", -0.1)],
)
def test_report_flags_impossible_values(tmp_path, column, value):
    """Defect 11: negative times and speedups were printed without a word."""
    from test_cli_report import results, write

    rows = results()
    rows[2][column] = value
    f = write(tmp_path / "neg.csv", rows)
    for cmd in (["report", str(f)], ["report", "compare", str(f), str(f)]):
        _refused(cmd, "impossible value", column, "line 4")


# ---------------------------------------------------------------- 7: every float option finite, in range


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(value, tmp_path):
    """Defect 7: timeout_s = nan passed validation; the watchdog busy-polled and never timed out."""
    _refused(["bench", "run", "--model", "tiny-qwen3", "--timeout", value], "timeout_s", "finite")
    suite = tmp_path / "nan.toml"
    suite.write_text(f'[measure]\ntimeout_s = {value}\n[defaults]\nmodel = "tiny-qwen3"\n')
    _refused(["bench", "sweep", str(suite)], "timeout_s")


@pytest.mark.parametrize("option", ["--dedup-ratio", "--fail-above"])
def test_other_float_options_refuse_nan(option, tmp_path):
    if option == "--dedup-ratio":
        _refused(["bench", "run", "--model", "tiny-qwen3", option, "nan"], "prompt_dedup_ratio")
    else:
        from test_cli_report import results, write

        f = write(tmp_path / "r.csv", results())
        _refused(["report", "compare", str(f), str(f), option, "nan"], "out of range")
