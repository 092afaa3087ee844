"""`zorro verify vision` (zorro_core.verify.vision): the vision families under verify's rule, its
planted bug failing, bad options refused."""

import json

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_core.verify.vision import VisionCase, run_vision_case, vision_cases

runner = CliRunner()


def test_a_clean_case_passes_and_the_planted_bug_fails():
    res = runner.invoke(
        app,
        [
            "verify",
            "vision",
            "--families",
            "qwen2_5_vl",
            "--dtype",
            "float64",
            "--mode",
            "split",
            "--no-checkpointing",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["counts"] == {"pass": 1, "fail": 0, "error": 0}
    assert report["cases"][0]["worst_ratio"] <= 1.0
    bad = run_vision_case(VisionCase("qwen3_vl"), bug="text_positions")
    assert bad.status == "fail" and bad.worst_ratio > 100, (bad.status, bad.worst_ratio)


def test_checkpointing_with_a_frozen_tower_passes():
    res = run_vision_case(VisionCase("qwen3_vl", checkpointing="reentrant", frozen_tower=True))
    assert res.status == "pass", res.reason
    assert res.dedup is not None and not any(n.startswith("model.visual.") for n in res.dedup.grads)


@pytest.mark.parametrize(
    "args,match",
    [
        (["--families", "gemma3"], "--families: unknown value 'gemma3'"),
        (["--dtype", "float16"], "--dtype: unknown value 'float16'"),
        (["--inject-bug", "nope"], "--inject-bug: unknown bug 'nope'"),
    ],
)
def test_bad_options_are_refused(args, match):
    res = runner.invoke(app, ["verify", "vision", *args])
    assert res.exit_code == 2 and match in res.output, res.output


def test_cases_refuse_an_unknown_value():
    with pytest.raises(ValueError, match="unknown mode 'both'"):
        vision_cases(modes=["both"])
