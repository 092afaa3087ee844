"""Issue 23 (faults, second pass): each defect reproduced, then fixed. The bad inputs of the same
issue (one-line errors, exit 2) are in test_cli_bad_inputs.py."""

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_core.bench.distributed import distributed_case_rows
from zorro_core.bench.runner import case_base_row
from zorro_core.bench.suite import Case, Measure
from zorro_core.verify import guard

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
