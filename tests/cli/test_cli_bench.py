"""`zorro bench`: sweeps end to end on CPU, resume, failures as rows, GPU suites on a CPU machine."""

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.results import COLUMNS, REQUIRED_COLUMNS, read_rows
from zorro_harness.bench.runner import case_rows
from zorro_harness.bench.suite import Case, Measure

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "data" / "tiny_suite.toml"
runner = CliRunner()


def sweep(*args):
    return runner.invoke(app, ["bench", "sweep", *map(str, args)])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "tiny.csv"
    res = sweep(TINY, "--out", out)
    assert res.exit_code == 0, res.output
    return out, res.output


def test_tiny_suite_end_to_end(tiny_run):
    out, output = tiny_run
    with out.open() as f:
        header = next(csv.reader(f))
    assert header[: len(REQUIRED_COLUMNS)] == REQUIRED_COLUMNS and header == COLUMNS
    rows = read_rows(out)
    assert [(r["num_unique_prompts"], r["phase"]) for r in rows] == [
        ("1", "forward"),
        ("1", "forward_backward"),
        ("4", "forward"),
        ("4", "forward_backward"),
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["baseline_kind"] == "packed_varlen_sdpa" and r["dedup_kind"] == "split_sdpa"
        assert float(r["dedup_ms_p20"]) <= float(r["dedup_ms_p50"]) <= float(r["dedup_ms_p80"])
        assert int(r["n"]) == 3 and float(r["speedup"]) > 0 and float(r["speedup_err"]) >= 0
        assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / float(r["ideal_speedup"]), rel=1e-3)
        assert float(r["baseline_tokens_per_s"]) > 0 and r["logical_tokens"] == "80"
        assert r["peak_mem_kind"] == "cpu_peak_rss_growth_fresh_process"
        assert float(r["baseline_peak_mem_mib"]) >= 0 and float(r["dedup_peak_mem_mib"]) >= 0
    shared, alone = rows[0], rows[2]
    assert float(shared["prompt_dedup_ratio"]) == 0.75 and float(shared["token_redundancy"]) == 0.6
    assert float(shared["ideal_speedup"]) > 2 and float(alone["ideal_speedup"]) == 1.0
    side = json.loads(out.with_suffix(".json").read_text())["runs"][0]
    for key in ("git_sha", "git_dirty", "command", "started_utc", "finished_utc", "seed", "environment", "suite_text"):
        assert key in side, key
    assert side["environment"]["torch"] == torch.__version__ and "threads" in side["environment"]
    assert "speedup" in output and "ok" in output


def test_interrupted_sweep_resumes_without_repeating_or_losing_rows(tiny_run, tmp_path):
    out = tmp_path / "tiny.csv"
    shutil.copy(tiny_run[0], out)
    shutil.copy(tiny_run[0].with_suffix(".json"), out.with_suffix(".json"))
    lines = out.read_text().splitlines(keepends=True)
    # Killed while writing the third row: two rows done, a partial line left behind.
    out.write_text("".join(lines[:3]) + lines[3][:25])
    kept = lines[1:3]
    res = sweep(TINY, "--out", out, "--resume", "--no-memory")
    assert res.exit_code == 0, res.output
    assert "1 case(s) already done" in res.output
    after = out.read_text().splitlines(keepends=True)
    assert after[1:3] == kept  # finished rows untouched
    rows = read_rows(out)
    keys = [(r["case_id"], r["phase"]) for r in rows]
    assert len(keys) == len(set(keys)) == 4 and all(r["status"] == "ok" for r in rows)
    assert len(json.loads(out.with_suffix(".json").read_text())["runs"]) == 2
    # Resuming a finished sweep runs nothing.
    res = sweep(TINY, "--out", out, "--resume")
    assert res.exit_code == 0 and len(read_rows(out)) == 4


def test_a_case_that_raises_is_an_error_row_and_the_sweep_goes_on(tmp_path):
    suite = tmp_path / "bad.toml"
    suite.write_text(
        TINY.read_text().replace(
            "[[grid]]\nnum_unique_prompts = [1, 4]",
            '[[grid]]\nactor.attn_implementation = ["flash_attention_2", "sdpa"]\nactor.use_split_attention = false',
        )
    )
    out = tmp_path / "bad.csv"
    res = sweep(suite, "--out", out, "--no-memory", "--repeats", "1", "--warmup", "0")
    assert res.exit_code == 1, res.output
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["error", "error", "ok", "ok"]
    assert "flash" in rows[0]["error"].lower() and rows[0]["speedup"] == ""
    assert rows[0]["ideal_speedup"] != ""  # known before anything runs


def test_flash_attention_split_cases_skip_on_cpu(tmp_path):
    """A GPU suite run with --device cpu: flash-attn split cases are skipped rows with the reason."""
    suite = tmp_path / "flash.toml"
    suite.write_text(
        TINY.read_text().replace(
            "[[grid]]\nnum_unique_prompts = [1, 4]", '[[grid]]\nactor.attn_implementation = ["flash_attention_2"]'
        )
    )
    out = tmp_path / "flash.csv"
    res = sweep(suite, "--out", out, "--no-memory", "--repeats", "1", "--warmup", "0")
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["skipped", "skipped"], res.output
    assert "CUDA" in rows[0]["error"]


def test_unknown_model_is_an_error_row(tmp_path):
    rows = case_rows(
        Case(model="no-such-model", batch_size=2, prompt_len=4, response_len=2, num_unique_prompts=1),
        Measure(repeats=1, memory=False),
    )
    assert [r["status"] for r in rows] == ["error", "error"] and "cannot resolve model" in rows[0]["error"]


@pytest.mark.parametrize(
    "fault,status,text", [("exit", "crashed", "exit code 3"), ("sleep", "timeout", "no result within")]
)
def test_crash_and_timeout_become_rows(fault, status, text):
    case = Case(model="tiny-qwen3", batch_size=2, prompt_len=4, response_len=2, num_unique_prompts=1)
    rows = case_rows(case, Measure(repeats=1, memory=False, timeout_s=5), fault=fault)
    assert [r["status"] for r in rows] == [status, status] and text in rows[0]["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_suite_on_cpu_is_skipped_with_a_reason(tmp_path):
    out = tmp_path / "gpu.csv"
    res = sweep(ROOT / "suites" / "gpu.toml", "--out", out, "--filter", "b16u2p8192r512")
    assert res.exit_code == 0, res.output
    assert "not available here" in res.output
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert "no CUDA" in rows[0]["error"] and float(rows[0]["ideal_speedup"]) > 1


def test_quick_suite_subset_end_to_end(tmp_path):
    """The shipped quick suite, one case, fewer repeats (the full suite is the README's main job)."""
    out = tmp_path / "quick.csv"
    res = sweep(
        ROOT / "suites" / "quick.toml",
        "--out",
        out,
        "--filter",
        "b8u1p128r32",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--no-memory",
    )
    assert res.exit_code == 0, res.output
    rows = read_rows(out)
    assert [r["status"] for r in rows] == ["ok", "ok"] and rows[0]["model"] == "small-qwen3"
    assert rows[0]["weights"] == "random"  # a preset: the results say its log-probs are not a real model's


@pytest.mark.slow
def test_full_quick_suite(tmp_path):
    """`pytest -m slow`: the README's main job, whole."""
    out = tmp_path / "quick.csv"
    res = sweep(ROOT / "suites" / "quick.toml", "--out", out)
    assert res.exit_code == 0, res.output
    assert all(r["status"] == "ok" for r in read_rows(out))


def test_bench_run_one_case_from_flags(tmp_path):
    out = tmp_path / "run.csv"
    args = [
        "bench",
        "run",
        "--model",
        "tiny-qwen3",
        "--attn",
        "eager",
        "--batch-size",
        "4",
        "--prompt-len",
        "12",
        "--response-len",
        "3",
        "--repeats",
        "2",
        "--phase",
        "forward",
        "--no-memory",
    ]
    res = runner.invoke(app, args + ["--unique-prompts", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = read_rows(out)
    assert len(rows) == 1 and rows[0]["status"] == "ok" and rows[0]["baseline_kind"] == "packed_varlen_reference"
    assert rows[0]["case_id"] == "tiny-qwen3:eager:split:compute:float32:cpu:b4u2p12r3"
    assert rows[0]["threads"] == "1"  # one thread unless --threads says otherwise, as in the suites
    res = runner.invoke(app, args + ["--dedup-ratio", "0.5", "--mask"])
    assert res.exit_code == 0, res.output
    assert ":mask:" in res.output and "\U0001f637" not in res.output  # an id, not rich's :mask: emoji


def test_bench_bad_input_exits_2(tmp_path):
    assert runner.invoke(app, ["bench", "run", "--logits-mode", "fast"]).exit_code == 2
    bad = tmp_path / "bad.toml"
    bad.write_text("[defaults]\nbatchsize = 4\n")
    res = sweep(bad)
    assert res.exit_code == 2 and "did you mean 'batch_size'" in res.output
    assert sweep(TINY, "--filter", "nothing-matches").exit_code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path of the liger axis")
def test_liger_case_is_skipped_with_the_reason_here(tmp_path):
    import multiprocessing as mp

    from zorro_harness.bench.runner import timing_process

    case = Case(model="tiny-qwen3", batch_size=2, prompt_len=4, response_len=2, num_unique_prompts=1, liger=True)
    assert case.case_id.endswith(":liger")
    rows = case_rows(case, Measure(repeats=1, memory=False))  # known up front: no process started
    assert (
        [r["status"] for r in rows] == ["skipped", "skipped"]
        and "CUDA" in rows[0]["error"]
        and rows[0]["liger"] is True
    )
    # In the case process (where a GPU case is checked, with the model on its device) it is a skip too.
    reader, writer = mp.Pipe(duplex=False)
    timing_process(case, Measure(repeats=1, memory=False), None, ("baseline", "dedup"), writer)
    payload = reader.recv()
    assert payload["status"] == "skipped" and payload["error"].startswith("Liger kernels")
    # A sweep writes the column and does not fail on the skipped case.
    suite = tmp_path / "liger.toml"
    suite.write_text(
        TINY.read_text().replace("num_unique_prompts = [1, 4]", "num_unique_prompts = 1\nliger = [false, true]")
    )
    out = tmp_path / "liger.csv"
    res = sweep(suite, "--list")
    assert res.output.split() == [
        "tiny-qwen3:sdpa:split:compute:float32:cpu:b4u1p16r4",
        "tiny-qwen3:sdpa:split:compute:float32:cpu:b4u1p16r4:liger",
    ]
    res = sweep(suite, "--out", out, "--no-memory", "--repeats", "1", "--warmup", "0", "--filter", "liger=true")
    assert res.exit_code == 0, res.output
    got = read_rows(out)
    assert [(r["liger"], r["status"]) for r in got] == [("True", "skipped")] * 2 and "need a CUDA GPU" in got[0][
        "error"
    ]


def test_checkpointing_axis(tmp_path):
    """--checkpointing: both arms run with transformers' checkpointing in training mode; the row records it."""
    from zorro_harness.bench.case_process import _Bench

    case = Case(
        model="tiny-qwen3", batch_size=4, prompt_len=16, response_len=4, num_unique_prompts=1, checkpointing=True
    )
    assert case.case_id.endswith(":ckpt")
    bench = _Bench(case, threads=1)
    assert bench.model.training and all(layer.gradient_checkpointing for layer in bench.model.model.layers)
    out = tmp_path / "ckpt.csv"
    res = runner.invoke(
        app,
        [
            "bench",
            "run",
            "--model",
            "tiny-qwen3",
            "-b",
            "4",
            "-u",
            "1",
            "-p",
            "16",
            "-r",
            "4",
            "--checkpointing",
            "--repeats",
            "1",
            "--phase",
            "forward_backward",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    (row,) = read_rows(out)
    assert row["status"] == "ok" and row["checkpointing"] == "True" and row["case_id"].endswith(":ckpt")
    assert float(row["baseline_peak_mem_mib"]) >= 0 and float(row["dedup_peak_mem_mib"]) >= 0


def test_suite_errors_keep_their_brackets(tmp_path):
    """Rich read "[measure]" as markup and printed "in ;"."""
    suite = tmp_path / "bad.toml"
    suite.write_text(TINY.read_text().replace("repeats = 3", "repeats = 3\nrepeat = 2"))
    res = sweep(suite, "--list")
    assert res.exit_code == 2 and "unknown key 'repeat' in [measure]; did you mean 'repeats'?" in " ".join(
        res.output.split()
    )
    suite.write_text(TINY.read_text().replace("num_unique_prompts = [1, 4]", "num_unique_prompt = [1, 4]"))
    res = sweep(suite, "--list")
    assert res.exit_code == 2 and "in [[grid]] #1" in res.output


def test_an_unknown_model_is_found_when_the_suite_loads(tmp_path):
    suite = tmp_path / "typo.toml"
    suite.write_text(TINY.read_text().replace('model = "tiny-qwen3"', 'model = "tiny-qwen33"'))
    out = tmp_path / "typo.csv"
    res = sweep(suite, "--out", out)
    assert res.exit_code == 2 and "cannot resolve model 'tiny-qwen33'" in " ".join(res.output.split())
    assert not out.exists()  # nothing ran, nothing written
