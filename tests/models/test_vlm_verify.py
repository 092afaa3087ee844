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
    assert report["counts"] == {"pass": 2, "fail": 0, "error": 0}  # --sharing: prompt and prefix by default
    assert [c["case"] for c in report["cases"]] == ["qwen2_5_vl/float64/split", "qwen2_5_vl/float64/split/prefix"]
    assert all(c["worst_ratio"] <= 1.0 for c in report["cases"])
    bad = run_vision_case(VisionCase("qwen3_vl"), bug="text_positions")
    assert bad.status == "fail" and bad.worst_ratio > 100, (bad.status, bad.worst_ratio)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_qwen3_5_cases_pass_and_the_planted_bug_fails(family, sharing):
    """Qwen3.5 (gated DeltaNet layers) under verify's rule: float64 (the float64 delta rule in reference
    and actors) and bfloat16 (within the plain computation's noise) pass; 1-D positions fail."""
    for dtype, mode in (("float64", "split"), ("bfloat16", "mask")):
        ok = run_vision_case(VisionCase(family, dtype, mode, sharing=sharing))
        assert ok.status == "pass" and ok.worst_ratio <= 1.0, (dtype, ok.status, ok.reason, ok.worst_ratio)
    bad = run_vision_case(VisionCase(family, sharing=sharing), bug="text_positions")
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


def _gradients(*args: str):
    return runner.invoke(
        app,
        ["verify", "gradients", "--dtype", "float64", "--attn", "sdpa", "--logits-mode", "compute", "--json", *args],
    )


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_verify_gradients_runs_the_vision_models_with_images(sharing):
    """`zorro verify gradients --models tiny-qwen2.5-vl,tiny-qwen3-vl` proves the vision path (layout
    "images") by its rule, in both sharing modes; the planted bug fails it by orders of magnitude."""
    res = _gradients("--models", "tiny-qwen2.5-vl,tiny-qwen3-vl", "--mode", "split", "--sharing", sharing)
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["summary"]["pass"] == 2 and report["passed"]
    cases = report["results"]
    assert [c["layout"] for c in cases] == ["images", "images"]
    assert all(c["actor"]["sharing"] == sharing for c in cases)
    assert all(any(p.startswith("model.visual.") for p in c["dedup"]["grad_rel_err"]) for c in cases)
    bad = _gradients(
        "--models", "tiny-qwen3-vl", "--mode", "mask", "--sharing", sharing, "--inject-bug", "wrong_prompt"
    )
    assert bad.exit_code == 1, bad.output
    assert json.loads(bad.output)["results"][0]["worst_ratio"] > 100


def test_verify_gradients_skips_what_the_vision_models_do_not_run():
    res = _gradients("--models", "tiny-qwen2.5-vl", "--mode", "split", "--lora", "2")
    report = json.loads(res.output)
    assert res.exit_code == 1 and report["summary"]["skip"] == 1  # nothing verified is not a pass
    assert "--lora is not run on the vision models" in report["results"][0]["reason"]


def test_the_default_models_include_the_vision_models():
    from zorro_core.verify.gradients import expand_cases, vision_models

    cases = expand_cases(
        ["tiny-qwen3", "tiny-qwen3-vl"], ["sdpa"], ["float64"], ["padded", "unpadded"], ["split"], ["compute"]
    )
    assert [(c.model, c.layout) for c in cases] == [
        ("tiny-qwen3", "padded"),
        ("tiny-qwen3", "unpadded"),
        ("tiny-qwen3-vl", "images"),
    ]
    assert set(vision_models()) == {"tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3.5-vl", "tiny-qwen3.5-moe-vl"}
    res = runner.invoke(app, ["verify", "gradients", "--help"])
    assert "tiny-qwen2.5-vl" in res.output
