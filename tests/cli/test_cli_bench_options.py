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


def test_run_flags_are_the_actor_fields_and_the_older_names_still_work(tmp_path):
    """--attn-implementation, --use-split-attention/--no-use-split-attention, --sharing, ...: one case,
    the same one as the older --attn and --split/--mask give."""
    import csv

    new, old = tmp_path / "new.csv", tmp_path / "old.csv"
    actor = ["--sharing", "prefix", "--min-shared-tokens", "2", "--logits-mode", "none", "--phase", "forward"]
    args = [*RUN, *actor, "--attn-implementation", "eager", "--no-use-split-attention", "--out", new]
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, [str(a) for a in [*RUN, *actor, "--attn", "eager", "--mask", "--out", old]])
    assert res.exit_code == 0, res.output
    (row,) = list(csv.DictReader(new.open()))
    assert row["case_id"] == next(csv.DictReader(old.open()))["case_id"]
    assert (row["attn_implementation"], row["split_attention"], row["logits_mode"]) == ("eager", "False", "none")
    assert (row["sharing"], row["min_shared_tokens"]) == ("prefix", "2") and row["case_id"].endswith(":prefix2")


def test_sweep_reads_old_suite_keys_with_a_note_and_filters_actor_options(tmp_path):
    suite = tmp_path / "old.toml"
    suite.write_text(
        '[defaults]\nmodel = "tiny-qwen3"\nsplit_attention = false\n[[grid]]\nlogits_mode = ["none", "memory"]\n'
    )
    res = runner.invoke(app, ["bench", "sweep", str(suite), "--list", "--filter", "actor.logits_mode=memory"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "'split_attention' is deprecated, write 'actor.use_split_attention'" in text
    assert "'logits_mode' is deprecated, write 'actor.logits_mode'" in text
    assert [line for line in res.output.splitlines() if line.startswith("tiny-qwen3")] == [
        "tiny-qwen3:sdpa:mask:memory:float32:cpu:b8u1p256r32"
    ]
