"""`zorro verify gradients --schedule prompt_once`: the schedule proved by verify's rule, float64 and low precision."""

import json

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_core.actor.schedule import Groups, cut_every_group
from zorro_core.verify.gradients import expand_cases, verify_batch, verify_cases

runner = CliRunner()


def test_verify_batch_is_cut_at_every_boundary():
    groups = Groups.of(verify_batch("padded", 256, seed=1))
    parts = cut_every_group(groups)
    assert len(parts) > 2
    for left, right in zip(parts, parts[1:]):  # each boundary splits the group on both of its sides
        assert groups.group_of_row[left[-1]] == groups.group_of_row[right[0]]


@pytest.mark.parametrize("max_tokens", [None, 3])
def test_schedule_passes_in_float64_and_bfloat16(max_tokens):
    cases = expand_cases(["tiny-qwen2-sliding"], ["sdpa"], ["float64", "bfloat16"], ["padded"], ["split"], ["none"])
    results = verify_cases(cases, schedule="prompt_once", max_tokens=max_tokens)
    assert [r.status for r in results] == ["pass", "pass"], [r.reason for r in results]
    assert all(r.worst_ratio <= 1.0 for r in results)


def test_cli_schedule_mode_and_its_refusals():
    args = ["verify", "gradients", "--models", "tiny-qwen3", "--dtype", "float64", "--layout", "unpadded"]
    args += ["--mode", "split", "--attn", "eager", "--logits-mode", "none", "--json"]
    res = runner.invoke(app, [*args, "--schedule", "prompt_once", "--max-tokens", "4"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["schedule"] == "prompt_once" and out["max_tokens"] == 4 and out["summary"]["pass"] == 1
    assert "needs --schedule prompt_once" in runner.invoke(app, [*args, "--max-tokens", "4"]).output
    assert "unknown schedule" in runner.invoke(app, [*args, "--schedule", "once"]).output


def test_schedule_mode_serves_prefix_tries_the_aux_loss_and_linear_attention():
    """The families the schedule once refused, proved by verify's rule in float64: an MoE model with
    each micro-batch's router aux loss in the loss (its value judged too) in a prefix trie, and
    Qwen3-Next's gated DeltaNet layers (with its MoE aux loss)."""
    from versions import QWEN3_NEXT_ADAPTABLE

    from zorro_core.actor.config import ActorConfig
    from zorro_core.verify.tolerances import AUX_RTOL

    cases = expand_cases(
        ["tiny-qwen3-moe"], ["sdpa"], ["float64"], ["padded"], ["split"], ["none"], ActorConfig(sharing="prefix")
    )
    if QWEN3_NEXT_ADAPTABLE:
        cases += expand_cases(["tiny-qwen3-next"], ["sdpa"], ["float64"], ["unpadded"], ["split"], ["none"])
    results = verify_cases(cases, schedule="prompt_once")
    assert [r.status for r in results] == ["pass"] * len(cases), [r.reason for r in results]
    for r in results:
        assert r.dedup.aux is not None and r.dedup.aux < AUX_RTOL and "aux_loss_rel_err" in r.to_dict()["dedup"]


def test_a_prefix_trie_on_a_kernel_pair_backend_stays_exact():
    """The kernel pair's region calls (each prompt self-causal, each response against its own prompt) do
    not hold for a trie, whose nodes attend to their ancestors: the schedule runs the dense call there.
    Both features met in one merge; without the guard the trie case's log-probs were off by 0.27."""
    from zorro_core.actor.config import ActorConfig

    cases = expand_cases(
        ["tiny-qwen3"],
        ["sdpa"],
        ["float64"],
        ["padded", "unpadded"],
        ["split"],
        ["none"],
        actor=ActorConfig(sharing="prefix"),
        varlen_backends=["flash_cpu"],
    )
    results = verify_cases(cases, schedule="prompt_once")
    assert [r.status for r in results] == ["pass", "pass"], [r.reason for r in results]


@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
def test_default_path_checks_the_aux_loss_under_checkpointing(flavour):
    """Issue 60, defect 4: with --checkpointing an MoE case's loss carries the router aux loss, judged against
    the per-sequence plain computation under the same checkpointing (value and every gradient); under
    reentrant checkpointing both lose the aux loss's gradient to the routers, which the case's reason says."""
    from zorro_core.verify.tolerances import AUX_RTOL

    cases = expand_cases(["tiny-qwen3-moe"], ["sdpa"], ["float64"], ["padded"], ["split"], ["none"])
    [r] = verify_cases(cases, checkpointing=flavour)
    assert r.status == "pass", r.reason
    assert r.dedup.aux is not None and r.dedup.aux < AUX_RTOL, r.dedup
    if flavour == "reentrant":
        assert "router aux loss" in r.reason and "no gradient" in r.reason, r.reason
    else:
        assert r.reason == "", r.reason


def test_default_path_aux_check_fails_on_a_wrong_aux_loss(monkeypatch):
    """The check has teeth: zorro's aux loss counting each packed token once (not per row) fails it."""
    from zorro_core.models import moe

    real = moe.router_aux_loss
    monkeypatch.setattr(
        "zorro_core.models.families.router_aux_loss",
        lambda logits, cfg, plan, weighting: real(logits, cfg, plan, "unique"),
    )
    cases = expand_cases(["tiny-qwen3-moe"], ["sdpa"], ["float64"], ["padded"], ["split"], ["none"])
    [r] = verify_cases(cases, checkpointing="reentrant")
    assert r.status == "fail" and "aux loss" in r.reason, r.reason
