"""zorro_core.verify.gradients: the pass rule, the cases it proves, and that it fails on broken plans."""

import math

import pytest
import torch

from zorro_core import ActorConfig, DeduplicatedActor, build_dedup_plan
from zorro_core.verify import tolerances
from zorro_core.verify.gradients import (
    FACTOR,
    GRAD_FLOOR,
    LP_FLOOR,
    CaseResult,
    Errors,
    Verifier,
    VerifyCase,
    case_unavailable,
    expand_cases,
    judge,
    tiny_models,
    verify_batch,
)
from zorro_core.verify.planted_bugs import BUGS, TREE_BUGS, inject_bug
from zorro_core.verify.reference import per_sequence, sequence_forward, token_weights


@pytest.fixture(scope="module")
def verifier():
    return Verifier()


def case(model: str, attn: str, dtype: str, layout: str, split: bool, logits_mode: str) -> VerifyCase:
    actor = ActorConfig(attn_implementation=attn, use_split_attention=split, logits_mode=logits_mode)
    return VerifyCase(model, dtype, layout, actor)


def errs(lp, ent, **grads):
    return Errors(lp, ent, grads)


def test_tiny_models_follow_presets_and_supported_families(monkeypatch):
    import zorro_core.models.presets as models
    import zorro_core.verify.gradients as verify

    found = tiny_models()
    assert {"tiny-qwen3", "tiny-llama", "tiny-qwen2"} <= set(found)
    assert not any(n.startswith("small-") for n in found)
    presets = dict(models.PRESETS, **{"tiny-new": ("qwen3", {}), "tiny-unsupported": ("gpt2", {})})
    monkeypatch.setattr(verify, "PRESETS", presets)
    assert "tiny-new" in tiny_models() and "tiny-unsupported" not in tiny_models()


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_rule_at_the_floor(dtype):
    clean = errs(0.0, 0.0, w=0.0)
    assert judge(dtype, errs(LP_FLOOR * 0.9, 0.0, w=GRAD_FLOOR * 0.9), clean)[2] == []
    failing = judge(dtype, errs(LP_FLOOR * 1.1, 0.0, w=GRAD_FLOOR * 1.1), clean)[2]
    assert len(failing) == 2 and failing[0].startswith("log-prob")


def test_rule_scales_with_the_baseline_noise_in_low_precision_only():
    base = errs(1e-2, 1e-3, a=1e-2, b=1e-4)
    within = errs(FACTOR * 1e-2, 1e-3, a=FACTOR * 1e-2, b=1e-4)
    ratio, _, failing = judge("bfloat16", within, base)
    assert failing == [] and ratio <= 1.0
    # Each parameter against its own baseline noise: b is 100x noisier than its baseline.
    ratio, check, failing = judge("bfloat16", errs(1e-2, 1e-3, a=1e-2, b=1e-2), base)
    assert check == "grad b" and ratio > 1 and failing == [f"grad b 1.00e-02 > {FACTOR * 1e-4 + GRAD_FLOOR:.2e}"]
    # float64 ignores the baseline: a noisy baseline does not excuse dedup.
    assert judge("float64", within, base)[2]
    assert judge("float32", errs(math.nan, 0.0), errs(0.0, 0.0))[0] == math.inf


def test_the_rule_uses_the_tolerances_defined_once():
    assert (LP_FLOOR, GRAD_FLOOR, FACTOR) == (tolerances.LOGPROB_ATOL, tolerances.GRAD_RTOL, 4.0)
    assert (LP_FLOOR, GRAD_FLOOR) == (1e-6, 1e-5)


def test_case_names_and_json_carry_the_actor_options():
    c = case("tiny-qwen3", "sdpa", "float32", "padded", False, "memory")
    assert c.name == "tiny-qwen3/sdpa/float32/padded/mask/memory"
    d = CaseResult(c, "skip", "why").to_dict()
    assert d["case"] == c.name and d["actor"]["use_split_attention"] is False and d["actor"]["logits_mode"] == "memory"
    cases = expand_cases(["tiny-qwen3"], ["eager"], ["float64"], ["padded"], ["split", "mask"], ["compute"],
                         ActorConfig(sharing="prefix", min_shared_tokens=1))  # fmt: skip
    assert [(x.actor.use_split_attention, x.actor.sharing, x.actor.min_shared_tokens) for x in cases] == [
        (True, "prefix", 1),
        (False, "prefix", 1),
    ]


def test_batches_of_each_layout():
    padded = verify_batch("padded", 256)
    assert not padded.prompt_mask.bool().all() and not padded.response_mask.bool().all()
    plan = build_dedup_plan(padded)
    assert sorted(plan.group_size.tolist()) == [1, 2, 3] and int(plan.response_lens.min()) == 1
    unpadded = verify_batch("unpadded", 256)
    assert unpadded.prompt_mask.bool().all() and unpadded.response_mask.bool().all()
    assert build_dedup_plan(unpadded).num_groups == 2
    with pytest.raises(ValueError, match="layout"):
        verify_batch("ragged", 256)


def test_sequence_forward_equals_per_sequence(tiny_models):
    model = tiny_models("tiny-qwen3")
    batch = verify_batch("padded", 256)
    lp, ent = sequence_forward(model, batch, 0.7)
    ref_lp, ref_ent, _ = per_sequence(model, batch, 0.7, token_weights(batch))
    assert torch.equal(lp.detach(), ref_lp) and torch.equal(ent.detach(), ref_ent)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["padded", "unpadded"])
@pytest.mark.parametrize(
    "split,attn,logits_mode", [(True, "eager", "compute"), (True, "sdpa", "memory"), (False, "sdpa", "none")]
)
def test_cases_pass(verifier, dtype, layout, split, attn, logits_mode):
    res = verifier.run(case("tiny-qwen3", attn, dtype, layout, split, logits_mode))
    assert res.status == "pass", res.reason
    assert res.worst_ratio < 0.5  # measured <= 0.42; a drift towards the limit is worth a look
    assert set(res.dedup.grads) == {n for n, _ in verifier.model("tiny-qwen3", dtype).named_parameters()}


@pytest.mark.parametrize("model", [m for m in tiny_models() if m != "tiny-qwen3"])
def test_every_supported_family_passes(verifier, model):
    res = verifier.run(case(model, "eager", "float64", "padded", True, "compute"))
    assert res.status == "pass", res.reason


@pytest.mark.parametrize("bug", list(BUGS))
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("split", [True, False])
def test_broken_plans_fail_by_far(verifier, monkeypatch, bug, dtype, split):
    monkeypatch.setattr(verifier, "bug", bug)
    res = verifier.run(case("tiny-qwen3", "sdpa", dtype, "padded", split, "compute"))
    assert res.status == "fail"
    assert res.worst_ratio > 10, (res.worst_ratio, res.reason)  # measured >= 11 (bfloat16), >= 1e4 (float64)


def test_injection_is_undone_and_must_take_effect(tiny_models):
    original = DeduplicatedActor.plan
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    with inject_bug("positions_restart", actor) as count:
        assert "plan" in vars(actor) and DeduplicatedActor.plan is original
        actor.forward(verify_batch("padded", 256))
    assert count["applied"] == 1 and DeduplicatedActor.plan is original and "plan" not in vars(actor)
    with pytest.raises(RuntimeError, match="never injected"):
        with inject_bug("wrong_prompt", actor):
            pass
    assert "plan" not in vars(actor)
    with pytest.raises(ValueError, match="unknown bug"):
        with inject_bug("nope", actor):
            pass


def test_injection_is_per_actor(tiny_models):
    """A bug planted in one actor leaves every other actor of the process (same model, same class) clean."""
    model = tiny_models("tiny-qwen3")
    batch = verify_batch("padded", 256)
    bugged, other = DeduplicatedActor(model=model), DeduplicatedActor(model=model)
    clean = other.forward(batch).log_probs.detach()
    with inject_bug("positions_restart", bugged) as count:
        assert torch.equal(other.forward(batch).log_probs.detach(), clean)
        assert torch.equal(other.plan(batch).position_ids, build_dedup_plan(batch).position_ids)
        wrong = bugged.forward(batch).log_probs.detach()
    assert count["applied"] == 1 and (wrong - clean).abs().max() > 1e-3


def test_injection_plants_the_trie_version_in_a_prefix_actor(tiny_models):
    """sharing="prefix": the plan is a TriePlan and gets the trie's version of the bug; a bug with no
    trie version is refused by name."""
    from zorro_core.plan.trie import TriePlan

    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"), sharing="prefix", min_shared_tokens=1)
    batch = verify_batch("padded", 256)
    clean = actor.plan(batch)
    assert isinstance(clean, TriePlan)
    with inject_bug("positions_restart", actor):
        bad = actor.plan(batch)
    assert isinstance(bad, TriePlan)
    assert torch.equal(bad.position_ids, clean.position_ids - clean.node_depth[clean.token_node])
    assert not torch.equal(bad.position_ids, clean.position_ids)
    with pytest.raises(ValueError, match="no sharing='prefix' version"):
        with inject_bug("first_label_dropped", actor):
            actor.plan(batch)


def test_unavailable_cases_skip_with_a_reason(verifier):
    assert "CUDA" in case_unavailable(
        case("tiny-qwen3", "flash_attention_2", "bfloat16", "padded", True, "compute"), "cpu"
    )
    assert "mask mode" in case_unavailable(
        case("tiny-qwen3", "flash_attention_2", "bfloat16", "padded", False, "compute"), "cpu"
    )
    res = verifier.run(case("tiny-qwen3", "flash_attention_2", "bfloat16", "padded", True, "compute"))
    assert res.status == "skip" and res.reason


def test_a_crash_is_an_error_row(verifier, monkeypatch):
    def boom(self, *a, **k):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(DeduplicatedActor, "forward", boom)
    res = verifier.run(case("tiny-qwen3", "eager", "float64", "padded", True, "compute"))
    assert res.status == "error" and "kernel exploded" in res.reason


@pytest.mark.parametrize("name", ["BUGS", "TREE_BUGS"])
def test_the_bug_tables_still_import_from_gradients_with_a_warning(name):
    import zorro_core.verify.gradients as gradients

    with pytest.warns(DeprecationWarning, match=f"zorro_core.verify.planted_bugs.{name} .removed after 2027-06-01"):
        got = getattr(gradients, name)
    assert got is {"BUGS": BUGS, "TREE_BUGS": TREE_BUGS}[name]
