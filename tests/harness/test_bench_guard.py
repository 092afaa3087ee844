"""Absurd sizes fail fast with the figure; a case that blows up anyway becomes a status=oom row
Nothing of a case is built in the calling process."""

import time

import pytest
from typer.testing import CliRunner

from zorro_cli.bench import parse_size
from zorro_cli.main import app
from zorro_core.models.registry import model_shape
from zorro_harness.bench.footprint import GIB, case_footprint, too_large
from zorro_harness.bench.inputs import model_config
from zorro_harness.bench.isolation import rss_of
from zorro_harness.bench.runner import case_rows
from zorro_harness.bench.suite import Case, Measure

runner = CliRunner()
ABSURD = ["bench", "run", "--model", "small-qwen3", "--attn", "sdpa", "--batch-size", "8", "--unique-prompts", "2",
          "--response-len", "32", "--threads", "1", "--prompt-len", "10000000"]  # fmt: skip


def test_the_issue_command_is_refused_at_once_with_the_figure():
    t0 = time.monotonic()
    res = runner.invoke(app, ABSURD)
    assert res.exit_code == 2, res.output
    assert time.monotonic() - t0 < 5
    text = " ".join(res.output.split())
    assert "needs at least" in text and "GiB" in text and "activations" in text and "available" in text


def test_a_suite_case_too_large_is_an_oom_row_and_the_caller_does_not_grow():
    import os

    case = Case(model="small-qwen3", batch_size=8, num_unique_prompts=2, prompt_len=10_000_000, response_len=32)
    before = rss_of(os.getpid())
    rows = case_rows(case, Measure(repeats=1, memory=False))
    assert rss_of(os.getpid()) - before < 100 * 2**20  # the batch (GiBs) was never built here
    assert [r["status"] for r in rows] == ["oom", "oom"]
    assert rows[0]["error"].startswith("refused before running: needs at least")


def test_max_memory_refuses_with_the_limit_named():
    res = runner.invoke(app, ABSURD[:-1] + ["512", "--max-memory", "1MiB"])
    assert res.exit_code == 2 and "--max-memory limit of 1 MiB" in " ".join(res.output.split())


@pytest.mark.parametrize("text,expect", [("512MiB", 512 * 2**20), ("4G", 4 * GIB), ("1.5GiB", int(1.5 * GIB)),
                                         ("2GB", 2 * 10**9)])  # fmt: skip
def test_parse_size(text, expect):
    assert parse_size(text) == expect


@pytest.mark.parametrize("text", ["12", "-1GiB", "lots", "0MiB"])
def test_parse_size_refuses(text):
    import typer

    with pytest.raises(typer.Exit) as e:
        parse_size(text)
    assert e.value.exit_code == 2


def test_footprint_is_a_lower_bound_by_part():
    case = Case(model="small-qwen3", batch_size=8, num_unique_prompts=2, prompt_len=128, response_len=32)
    config = model_config(case.model)
    shape = model_shape(config)
    fwd = case_footprint(case, config, ("forward",))
    both = case_footprint(case, config, ("forward", "forward_backward"))
    dedup = case_footprint(case, config, ("forward",), arm="dedup")
    tokens = 8 * 160
    assert fwd.activations == tokens * (shape.hidden_size + 2 * shape.intermediate_size) * 4  # one layer in flight
    assert both.activations == fwd.activations * shape.num_layers and both.weights == 2 * fwd.weights  # + gradients
    assert dedup.plan == (2 * 128 + 8 * 32) * 16 < fwd.plan
    assert fwd.logits == 8 * 32 * shape.vocab_size * 4
    assert too_large(fwd, fwd.total - 1, "cpu").startswith("needs at least")
    assert too_large(fwd, fwd.total, "cpu") is None


def test_only_the_arm_that_cannot_fit_is_refused():
    """A limit between the two arms' estimates: dedup is timed, baseline is an oom with its figure."""
    case = Case(model="tiny-qwen3", batch_size=256, num_unique_prompts=1, prompt_len=3000, response_len=1)
    config = model_config(case.model)
    base = case_footprint(case, config, ("forward",)).total
    dedup = case_footprint(case, config, ("forward",), arm="dedup").total
    limit = 512 * 2**20
    assert dedup < limit < base
    rows = case_rows(case, Measure(repeats=1, warmup=0, memory=False, phases=("forward",), threads=1), max_memory=limit)
    (row,) = rows
    assert row["status"] == "oom" and "baseline: refused before running" in row["error"], row
    assert row["dedup_ms_p50"] > 0 and "baseline_ms_p50" not in row and row["dedup_kind"] == "split_sdpa"


def test_a_process_that_grows_past_the_limit_is_stopped_as_oom():
    case = Case(model="tiny-qwen3", batch_size=2, prompt_len=4, response_len=2, num_unique_prompts=1)
    t0 = time.monotonic()
    rows = case_rows(case, Measure(repeats=1, memory=False, timeout_s=60), fault="grow", max_memory=256 * 2**20)
    assert [r["status"] for r in rows] == ["oom", "oom"] and "past --max-memory" in rows[0]["error"]
    assert time.monotonic() - t0 < 30
