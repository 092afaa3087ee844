"""`zorro bench memory --budget`: the prompt-once schedule against the within-micro-batch path,
counted on a tiny model (the Qwen3-8B shape is a documented command: docs/schedule.md)."""

import csv
import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from zorro_cli import bench_schedule
from zorro_cli.main import app
from zorro_core import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.schedule import prompt_once_step
from zorro_harness.bench import schedule_memory as sm

runner = CliRunner()
# 6 responses of 8 tokens to one 24-token prompt; a budget of 20 tokens: zorro today runs each row
# alone (24 + 8 > 20), the schedule 2 responses per micro-batch.
CASE = sm.ScheduleCase("tiny-qwen3", 6, 24, 8, 1, 20, "compute", "float32", layers=2, narrow=1)


@pytest.fixture(scope="module")
def count():
    return sm.memoised(sm.count_schedule_case)


def test_every_phase_saves_the_same_bytes_per_token(count):
    """Phase 1 (the prompt), a response micro-batch against the kept keys, and zorro's micro-batch
    (prompt + response) save the same bytes per token in each decoder layer, to the byte: the kept
    keys and values are referenced by phase 2, never saved again."""
    c = count(CASE)
    mb, po = c["micro_batch"], c["prompt_once"]
    assert (mb.micro_batches, mb.largest_tokens, mb.step_tokens) == (6, 32, 6 * 32)
    assert (po.micro_batches, po.largest_tokens, po.prompt_tokens, po.step_tokens) == (3, 16, 24, 24 + 48)
    per_token = mb.layer / mb.largest_tokens
    assert po.prompt_layer / po.prompt_tokens == per_token
    assert po.layer / po.largest_tokens == per_token
    assert po.kept_unsaved == 0  # phase 1's saved keys and values are the kept leaves' storage
    assert po.peak == po.saved + po.kept > mb.peak
    assert po.flops < mb.flops


def test_kept_bytes_are_the_schedules_own(count):
    """The kept keys and values found by the count equal what a whole prompt-once step reports
    (ScheduleOutput.kept_bytes, less the first-token hidden state it adds)."""
    model, cfg, _ = sm._model(CASE, 0)
    batch = sm._batch(CASE, cfg.vocab_size, 0)
    actor = DeduplicatedActor(model=model, config=ActorConfig(varlen_backend="flash_cpu"))
    res = prompt_once_step(actor, batch, lambda out, rows: out.log_probs.sum(), CASE.budget)
    first = CASE.unique * cfg.hidden_size * 4
    assert count(CASE)["prompt_once"].kept == res.kept_bytes - first
    assert len(res.parts) == count(CASE)["prompt_once"].micro_batches


def test_counts_are_affine_in_the_prompt_at_one_layout(count):
    for path in sm.SCHEDULE_PATHS:
        # one layout each: waves' phase 1 in 2 calls of at most 20 tokens at every P here
        ps = (22, 40, 31) if path == "waves" else (16, 40, 28)
        a, b, mid = (count(dataclasses.replace(CASE, prompt_len=p)) for p in ps)
        got = sm.at_prompt_len(a[path], b[path], ps[2])
        for field in ("prompt_layer", "prompt_outside", "kept", "layer", "outside", "peak", "peak_checkpointed"):
            assert getattr(got, field) == pytest.approx(getattr(mid[path], field), rel=1e-12), (path, field)
    a, b = (count(dataclasses.replace(CASE, prompt_len=p)) for p in (16, 40))
    with pytest.raises(ValueError, match="layouts"):  # waves: 1 phase-1 call at P = 16, 2 at 40
        sm.at_prompt_len(a["waves"], b["waves"], 28)
    with pytest.raises(ValueError, match="layouts"):
        sm.at_prompt_len(a["prompt_once"], count(dataclasses.replace(CASE, budget=8))["prompt_once"], 28)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_longest_prompt_search_gives_back_the_counted_prompt(count, checkpointed):
    """With the bytes of P = 24 as the budget, the search over P finds 24 on each path."""
    for path in sm.SCHEDULE_PATHS:
        c = count(CASE)[path]
        limit = c.peak_checkpointed if checkpointed else c.peak
        assert sm.longest_prompt_search(CASE, path, limit, checkpointed, count, hi=64) == 24
        assert sm.longest_prompt_search(CASE, path, 1.0, checkpointed, count, hi=64) == 0


def test_cli_budget_writes_both_paths(tmp_path, monkeypatch):
    """The command's wiring (the search itself is tested above): one count, in this process."""
    monkeypatch.setattr(bench_schedule, "count_schedule_isolated", sm.count_schedule_case)
    searched = []
    monkeypatch.setattr(bench_schedule, "longest_prompt_search", lambda case, path, *a: searched.append(path) or 7)
    out = tmp_path / "s.csv"
    args = ["bench", "memory", "--model", "tiny-qwen3", "--batch", "6", "--unique", "1", "--prompt-len", "24"]
    args += ["--response-len", "8", "--budget", "20", "--logits-mode", "memory", "--narrow", "2", "--gpu-gib", "0.001"]
    res = runner.invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(out.open()))
    assert [r["path"] for r in rows] == ["micro_batch", "prompt_once", "waves"]
    assert all(r["status"] == "ok" and float(r["ideal_speedup"]) > 1 for r in rows)
    assert int(rows[1]["kept_bytes"]) > 0 and int(rows[0]["kept_bytes"]) == 0
    assert "prompt-once schedule" in res.output
    assert sorted(searched) == sorted(sm.SCHEDULE_PATHS * 2) and rows[0]["longest_prompt_checkpointed"] == "7"
    res = runner.invoke(app, [*args, "--plot", str(tmp_path / "p.png")])
    assert res.exit_code == 2 and "--budget" in res.output


def test_a_schedule_off_the_kernel_pair_is_refused(monkeypatch):
    """The count reads the kept keys off phase 2's attention: on the dense fallback it finds none
    and says so, rather than a count without them."""
    monkeypatch.setattr(sm, "BACKEND", "sdpa")
    with pytest.raises(RuntimeError, match="kernel pair"):
        sm.count_schedule_case(dataclasses.replace(CASE, layers=1))
    assert torch.is_grad_enabled()


def test_a_longest_prompt_at_the_search_ceiling_says_so(capsys):
    """Issue 60: `--budget 1` reported a longest prompt of 4,194,304 without saying it is the search's ceiling."""
    from zorro_cli import bench_schedule
    from zorro_harness.bench.schedule_memory import LONGEST_PROMPT_CEILING

    row = {
        "status": "ok", "model": "m", "batch": 4, "prompt_len": 8, "response_len": 2, "budget": 1, "dtype": "bf16",
        "logits_mode": "compute", "unique": 1, "path": "prompt_once", "waves": "", "micro_batches": 4, "step_tokens": 8,
        "largest_tokens": 2, "saved_bytes": 0, "kept_bytes": 0, "peak_bytes": 0, "peak_checkpointed_bytes": 0,
        "flops_fwd_bwd": 0, "ideal_speedup": "", "longest_prompt": LONGEST_PROMPT_CEILING,
        "longest_prompt_checkpointed": 1000,
    }  # fmt: skip
    bench_schedule._print([row], 80.0, 1)
    out = " ".join(capsys.readouterr().out.split())
    assert f">= {LONGEST_PROMPT_CEILING:,}" in out and "ceiling" in out, out
    assert "1,000" in out


def test_waves_hold_one_waves_prompts(count):
    """At the budget the schedule holds one wave's prompts (here one 24-token group per wave, phase 1 in
    calls of at most 20), however many groups the step has; as one wave it holds all of them."""
    one, four = (count(dataclasses.replace(CASE, batch=2 * u, unique=u)) for u in (1, 4))
    w1, w4 = one["waves"], four["waves"]
    assert (w4.waves, w4.prompt_tokens, w4.chunk_tokens) == (4, 24, 12) and w1.waves == 1
    assert w4.kept == w1.kept and w4.peak_checkpointed == w1.peak_checkpointed and w4.peak == w1.peak
    assert four["prompt_once"].kept == 4 * one["prompt_once"].kept
    assert w4.peak_checkpointed < four["prompt_once"].peak_checkpointed and w4.peak < four["prompt_once"].peak
    assert w4.flops == four["prompt_once"].flops < four["micro_batch"].flops  # each prompt once either way
    # offload: phase 1's saved bytes leave the device (all of them without checkpointing)
    row = w4.as_dict()
    assert row["offload_host_bytes"] == round(w4.full_layers * w4.prompt_layer + w4.prompt_outside) > 0
    assert row["offload_peak_bytes"] == round(w4.peak - w4.host) < row["peak_bytes"]
    assert 0 < row["offload_host_checkpointed_bytes"] < row["offload_host_bytes"]
