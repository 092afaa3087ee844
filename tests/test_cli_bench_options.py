"""`zorro bench` options a user gives explicitly are checked before anything runs: a device that is
not here (--device cuda on a machine without CUDA) is an error, exit 2, not a skipped row and
exit 0; --threads is bounded by the machine's cores; a count below 1 is blamed on its own option."""

import os

import pytest
import torch
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.suite import Case, Measure

runner = CliRunner()
RUN = ["bench", "run", "--model", "tiny-qwen3", "-b", "2", "-p", "8", "-r", "2", "--repeats", "1", "--no-memory"]


def _refused(args, *words):
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "Traceback" not in text
    for w in words:
        assert w in text, text
    return text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_bench_run_on_an_absent_cuda_is_an_error(tmp_path):
    out = tmp_path / "r.csv"
    _refused([*RUN, "--device", "cuda", "--out", out], "--device cuda", "no CUDA")
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_sweep_device_cuda_given_explicitly_is_an_error(fake, tmp_path):
    res = fake("--device", "cuda", "--out", tmp_path / "r.csv")
    assert res.exit_code == 2 and "no CUDA" in res.output, res.output
    assert not (tmp_path / "r.csv").exists()


def test_threads_past_the_cores_are_refused():
    cores = os.cpu_count() or 1
    _refused([*RUN, "--threads", "100000"], "threads", "100000", f"{cores} CPU core")
    with pytest.raises(ValueError, match="CPU core"):
        Measure(threads=cores + 1)
    assert Measure(threads=cores).threads == cores


@pytest.mark.parametrize("field,flag", [("prompt_len", "-p"), ("response_len", "-r"), ("batch_size", "-b")])
def test_a_count_below_one_names_its_own_option(field, flag):
    with pytest.raises(ValueError, match=f"^{field} must be an integer >= 1"):
        Case(**{field: 0}, num_unique_prompts=1)
    args = [a for a in RUN]
    args[args.index(flag) + 1] = "0"
    text = _refused(args, field)
    assert "shared_prefix_len" not in text
