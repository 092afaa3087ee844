"""`zorro analyze`: the DESIGN's example and the ideal speedup per kind of work."""

import json

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app

runner = CliRunner()
EXAMPLE = ["analyze", "--prompt-len", "10000", "--responses", "10", "--response-len", "1000"]


def test_design_example_table():
    res = runner.invoke(app, EXAMPLE)
    assert res.exit_code == 0, res.output
    for text in ("110,000 (110K)", "20,000 (20K)", "82% of total", "5.50x", "linear", "attention", "lm_head", "total"):
        assert text in res.output, text


@pytest.mark.parametrize("model", ["Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B", "small-qwen3"])
def test_json(model):
    res = runner.invoke(app, EXAMPLE + ["--model", model, "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert (d["total_tokens"], d["unique_tokens"], d["redundant_tokens"]) == (110_000, 20_000, 90_000)
    assert d["token_redundancy"] == pytest.approx(0.818, abs=1e-3) and d["prompt_dedup_ratio"] == pytest.approx(0.9)
    sp = d["ideal_speedup"]
    assert sp["linear"] == pytest.approx(5.5) and sp["lm_head"] == pytest.approx(1.0)
    assert 3.5 < sp["attention"] < 4.0
    assert 1.0 < sp["total_forward"] < 5.5 and sum(d["flops_share_baseline"].values()) == pytest.approx(1.0)


def test_logits_none_and_several_prompts():
    d = json.loads(runner.invoke(app, EXAMPLE + ["--logits-mode", "none", "--prompts", "3", "--json"]).output)
    assert d["total_tokens"] == 330_000 and d["unique_tokens"] == 60_000
    assert d["ideal_speedup"]["lm_head"] == pytest.approx(5.5)


@pytest.mark.parametrize("args", [["--prompt-len", "0"], ["--logits-mode", "x"], ["--model", "nope"]])
def test_bad_input_exits_2(args):
    base = {"--prompt-len": "10", "--responses": "2", "--response-len": "3"}
    base.update(dict(zip(args[::2], args[1::2])))
    res = runner.invoke(app, ["analyze", *[x for kv in base.items() for x in kv]])
    assert res.exit_code == 2


def test_shared_prefix_reports_the_tree():
    args = [
        "analyze",
        "--prompt-len",
        "1152",
        "--responses",
        "4",
        "--response-len",
        "128",
        "--prompts",
        "4",
        "--shared-prefix-len",
        "1024",
        "--model",
        "small-qwen3",
    ]
    d = json.loads(runner.invoke(app, args + ["--json"]).output)
    pr = d["prefix"]
    assert pr["unique_tokens"] == 1024 + 4 * 128 + 16 * 128 and d["unique_tokens"] == 4 * 1152 + 16 * 128
    assert pr["ideal_speedup"]["total_forward_backward"] > d["ideal_speedup"]["total_forward_backward"]
    assert pr["ideal_speedup_over_prompt_sharing"] == pytest.approx(
        pr["ideal_speedup"]["total_forward_backward"] / d["ideal_speedup"]["total_forward_backward"]
    )
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "prefix tree" in res.output
    assert runner.invoke(app, args[:-2] + ["--shared-prefix-len", "1152"]).exit_code == 2


def test_the_report_is_the_librarys():
    """The CLI prints zorro_harness.analyze.analysis.workload_report's dict as it is."""
    from zorro_harness.analyze.analysis import workload_report

    report = workload_report(10000, 10, 1000, model="small-qwen3", logits_mode="none", prompts=2)
    cli = json.loads(
        runner.invoke(
            app, EXAMPLE + ["--model", "small-qwen3", "--logits-mode", "none", "--prompts", "2", "--json"]
        ).output
    )
    assert cli == report and "prefix" not in report  # floats survive JSON exactly
    assert workload_report(1152, 4, 128, prompts=4, model="small-qwen3", shared_prefix_len=1024)["prefix"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"prompt_len": 0}, "must be >= 1"),
        ({"shared_prefix_len": 10}, "shared_prefix_len"),
        ({"logits_mode": "full"}, "logits_mode"),
        ({"model": "nope"}, "cannot resolve model"),
    ],
)
def test_the_library_refuses_bad_workloads(kwargs, match):
    from zorro_harness.analyze.analysis import workload_report

    args = {"prompt_len": 10, "responses": 2, "response_len": 3, "model": "small-qwen3", **kwargs}
    with pytest.raises(ValueError, match=match):
        workload_report(**args)


def test_a_nan_in_the_report_is_not_printed(monkeypatch):
    """--json goes through print_json (allow_nan=False): a NaN is an error naming the field, not `NaN` in the output."""
    import zorro_cli.analyze as cli_analyze
    from zorro_harness.analyze.analysis import workload_report

    def with_a_nan(*args, **kwargs):
        report = workload_report(*args, **kwargs)
        report["ideal_speedup"]["attention"] = float("nan")
        return report

    monkeypatch.setattr(cli_analyze, "workload_report", with_a_nan)
    res = runner.invoke(app, EXAMPLE + ["--model", "small-qwen3", "--json"])
    assert res.exit_code != 0 and isinstance(res.exception, ValueError)
    assert "ideal_speedup.attention" in str(res.exception)
    assert "NaN" not in res.output and res.output.strip() == ""
