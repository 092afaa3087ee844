"""`zorro verify gradients` and `zorro verify training` through the CLI: tables, JSON, exit codes."""

import json

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app

runner = CliRunner()


def cases(models="tiny-qwen3", dtype="float64,bfloat16", layout="padded", logits_mode="compute", attn="sdpa"):
    """The options that choose the verified cases (the modes and the rest are added by each test)."""
    return ["--models", models, "--dtype", dtype, "--layout", layout, "--logits-mode", logits_mode, "--attn", attn]


SMALL = cases()


def invoke(*args):
    return runner.invoke(app, ["verify", *args])


def test_help_states_the_rules_and_hides_the_bug_option():
    text = " ".join(invoke("gradients", "--help").output.split())
    assert "4 x the baseline's + the float64 floor" in text and "1e-06" in text and "1e-05" in text
    assert "--inject-bug" not in text
    train = " ".join(invoke("training", "--help").output.split())
    assert "drift(dedup) <= 2 x drift(baseline) + 0.0001" in train


def test_gradients_pass_with_a_table():
    res = invoke("gradients", *SMALL, "--mode", "split", "--mode", "mask")
    assert res.exit_code == 0, res.output
    assert res.output.count("pass") >= 4 and "4 passed, 0 failed" in res.output and "Worst offenders" in res.output


@pytest.mark.parametrize("bug", [None, "wrong_prompt"])
def test_gradients_of_the_linear_attention_families_in_float64(bug):
    """Qwen3.5 dense and MoE (and Qwen3-Next), float64 at the float64 floor: the reference and the
    actors run the dtype-preserving delta rule (transformers' float32 one alone measured 1.2e-5 on
    tiny-qwen3.5's A_log, over the floor); a broken plan still fails."""
    args = cases("tiny-qwen3.5,tiny-qwen3.5-moe,tiny-qwen3-next", "float64", attn="eager")
    res = invoke("gradients", *args, "--mode", "split", *(["--inject-bug", bug] if bug else []))
    if bug is None:
        assert res.exit_code == 0 and "3 passed, 0 failed" in res.output, res.output
    else:
        assert res.exit_code == 1 and "0 passed, 3 failed" in res.output, res.output


@pytest.mark.parametrize("bug", ["wrong_prompt", "positions_restart", "first_label_dropped"])
def test_gradients_fail_on_a_broken_plan(bug):
    res = invoke("gradients", *SMALL, "--mode", "split", "--inject-bug", bug)
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output and "0 passed, 2 failed" in res.output


def test_gradients_json():
    args = cases("tiny-llama", "float32", "unpadded", logits_mode="none", attn="eager,flash_attention_2")
    res = invoke("gradients", *args, "--mode", "split", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["passed"] and out["summary"] == {"pass": 1, "fail": 0, "error": 0, "skip": 1}
    ok = next(r for r in out["results"] if r["status"] == "pass")
    assert ok["dedup"]["worst_param"] and ok["dedup"]["grad_rel_err"] and "Pass rule" in out["rule"]


def test_nothing_verified_is_not_a_pass():
    res = invoke("gradients", *cases(dtype="bfloat16", attn="flash_attention_2"), "--mode", "split")
    assert res.exit_code == 1 and "0 passed" in res.output


@pytest.mark.parametrize(
    "args,hint",
    [
        (["--models", "tiny-nope"], "--models"),
        (["--dtype", "float8"], "--dtype"),
        (["--inject-bug", "typo"], "--inject-bug"),
    ],
)
def test_bad_options_exit_2(args, hint):
    res = invoke("gradients", *args)
    assert res.exit_code == 2 and hint in res.output


def test_training_passes_and_fails_on_a_broken_plan():
    args = ["training", "--steps", "2", "--models", "tiny-qwen3", "--dtype", "float64"]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert "1 passed, 0 failed" in res.output and "drift dedup" in res.output
    res = invoke(*args, "--inject-bug", "first_label_shared", "--json")
    assert res.exit_code == 1
    out = json.loads(res.output)
    assert not out["passed"] and out["results"][0]["status"] == "fail"


def test_lora_compares_adapter_gradients_and_can_fail():
    pytest.importorskip("peft")
    args = [*cases(dtype="float64"), "--mode", "split", "--lora", "4", "--json"]
    res = invoke("gradients", *args)
    assert res.exit_code == 0, res.output
    case = json.loads(res.output)["results"][0]
    assert "lora_A" in case["dedup"]["worst_param"] or "lora_B" in case["dedup"]["worst_param"]
    assert invoke("gradients", *args, "--inject-bug", "wrong_prompt").exit_code == 1


@pytest.mark.parametrize("reentrant", [[], ["--reentrant"]])
def test_checkpointing_passes_and_can_fail(reentrant):
    args = [
        *cases("tiny-qwen3-next,tiny-mistral", "float64"),
        "--mode",
        "split",
        "--checkpointing",
        *reentrant,
        "--json",
    ]
    res = invoke("gradients", *args)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["checkpointing"] == ("reentrant" if reentrant else "non-reentrant")
    assert out["summary"] == {"pass": 2, "fail": 0, "error": 0, "skip": 0}
    assert invoke("gradients", *args, "--inject-bug", "wrong_prompt").exit_code == 1


def test_reentrant_needs_checkpointing():
    res = invoke("gradients", "--reentrant")
    assert res.exit_code == 2 and "--reentrant" in res.output


@pytest.mark.parametrize("args,reason", [
    (["--factor", "-1"], "--factor must be a finite number > 0, got -1"),
    (["--factor", "0"], "--factor must be a finite number > 0, got 0"),
    (["--device", "tpu"], "--device 'tpu' is not a device zorro runs on"),
    (["--models", ""], "--models is empty"),
])  # fmt: skip
def test_bad_values_are_refused_with_the_reason(args, reason):
    """A negative factor passed, tpu was a traceback, "" ran nothing."""
    for command in ("gradients", "training"):
        res = invoke(command, *args)
        assert res.exit_code == 2 and reason in " ".join(res.output.split()), (command, res.output)
        assert "Traceback" not in res.output


def test_gradients_prefix_sharing_passes_with_linear_attention():
    res = invoke("gradients", *SMALL, "--mode", "split", "--mode", "mask", "--sharing", "prefix")
    assert res.exit_code == 0, res.output
    assert "4 passed, 0 failed" in res.output
    res = invoke("gradients", *cases("tiny-qwen3-next", "float64"), "--mode", "split", "--sharing", "prefix", "--json")
    out = json.loads(res.output)
    assert out["summary"]["pass"] == 1, out


@pytest.mark.parametrize("bug", ["wrong_prompt", "positions_restart"])
def test_gradients_prefix_sharing_fail_on_a_broken_plan(bug):
    res = invoke("gradients", *SMALL, "--mode", "split", "--sharing", "prefix", "--inject-bug", bug)
    assert res.exit_code == 1, res.output
    assert "0 passed, 2 failed" in res.output


def test_gradients_unknown_sharing_is_an_error():
    res = invoke("gradients", *SMALL, "--sharing", "suffix")
    assert res.exit_code == 2 and "--sharing" in res.output and "suffix" in res.output


def test_a_named_backend_that_never_ran_fails_the_run():
    """Issue 60, defect 6: `--varlen-backend flash_attn` on a CPU machine passed on its mask-mode cases alone."""
    args = [*cases(dtype="float64", attn="sdpa"), "--mode", "split,mask", "--varlen-backend", "flash_attn"]
    res = invoke("gradients", *args, "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.output)
    assert out["summary"]["pass"] >= 1 and out["passed"] is False, out["summary"]
    assert out["unverified_backends"] == ["flash_attn"], out
    table = invoke("gradients", *args)
    assert table.exit_code == 1
    assert "flash_attn" in table.output and "never ran" in table.output, table.output
    # a backend that ran passes as before
    ok = invoke("gradients", *cases(dtype="float64"), "--mode", "split,mask", "--varlen-backend", "sdpa", "--json")
    assert ok.exit_code == 0 and json.loads(ok.output)["unverified_backends"] == [], ok.output
