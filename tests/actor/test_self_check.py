"""The self-check (zorro_core.actor.self_check): a right backend passes and keeps its path; a planted
wrong-gradient kernel (#46 item 1: each head's backward reads another head's lse) is caught on two
gloo ranks, which agree, fall back, warn once with the numbers and report the metric, and whose
results after falling back equal the float64 per-sequence reference; the switch turns it off."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

from zorro_core.actor import self_check
from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.self_check import SelfCheckWarning
from zorro_core.attention.kernels import CpuFlashPair
from zorro_core.distributed.launch import launch
from zorro_core.models.presets import build_model, preset_config
from zorro_core.plan.batch import create_dummy_batch
from zorro_core.verify import tolerances
from zorro_core.verify.reference import max_abs_error, max_rel_grad_error, per_sequence, token_weights


def _model():
    return build_model(preset_config("tiny-qwen3"), dtype=torch.float64)


def _batch(model, seed=0):
    vocab = model.config.vocab_size
    return create_dummy_batch(6, 2, prompt_len=12, response_len=6, vocab_size=vocab, vary_lengths=True, seed=seed)


@contextlib.contextmanager
def wrong_head_lse():
    """#46 item 1 put back: the flash_cpu pair's backward reads each head's lse from the next head."""
    original = CpuFlashPair.backward

    def backward(self, dout, q, k, v, out, lse, *args, **kwargs):
        return original(self, dout, q, k, v, out, lse.roll(1, 0), *args, **kwargs)

    CpuFlashPair.backward = backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        CpuFlashPair.backward = original  # type: ignore[method-assign]


def test_the_rule_is_the_proofs():
    assert self_check.LOGPROB_FLOOR == tolerances.LOGPROB_ATOL
    assert self_check.GRAD_FLOOR == tolerances.GRAD_RTOL
    assert self_check.FACTOR == tolerances.LOW_PRECISION_FACTOR


def test_a_right_backend_passes_and_keeps_its_path():
    model = _model()
    model.train()
    model.model.layers[0].eval()  # each module's own mode is put back after the check (run in eval mode)
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelfCheckWarning)
        actor.forward(_batch(model))
        actor.forward(_batch(model, seed=1))  # the same key: checked once
    (verdict,) = actor.self_check.verdicts.values()
    assert verdict.key == ("split", "flash_cpu", "sdpa", "float64", "PromptPlan")
    assert verdict.passed and verdict.grad_error < verdict.grad_allowed == tolerances.GRAD_RTOL
    assert actor.self_check.failed is None and actor.self_check.spec is None
    assert actor.self_check.metric() == 1.0
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert all(p.grad is None for p in model.parameters())  # the check's backward touches no .grad


def test_the_switch_turns_it_off(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the self-check ran")

    monkeypatch.setattr(self_check, "check", never)
    model = _model()
    for options in ({"self_check": False}, {}):  # off explicitly, and by default on CPU
        actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", **options)
        with wrong_head_lse():
            actor.forward(_batch(model))
        assert actor.self_check.metric() is None and not actor.self_check.verdicts


def _planted_rank(seed: int) -> dict:
    """One gloo rank: the planted bug, forward_backward through the self-checking actor, compared with
    the float64 per-sequence reference."""
    model = _model()
    batch = _batch(model, seed=seed + torch.distributed.get_rank())
    weights = token_weights(batch)
    lp_ref, _, grads_ref = per_sequence(model, batch, weights=weights, entropy=False)
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    w_lp = weights[0]
    with warnings.catch_warnings(record=True) as caught, wrong_head_lse():
        warnings.simplefilter("always")
        model.zero_grad(set_to_none=True)
        out = actor.forward_backward(batch, lambda o, rows: (o.log_probs * w_lp[rows]).sum())
        actor.forward(batch)  # a later call: no second check, no second warning
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # Only rank 0's kernel is wrong: rank 1 passes its own check, yet takes rank 0's verdict.
    alone = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    with warnings.catch_warnings(record=True) as caught_alone:
        warnings.simplefilter("always")
        with wrong_head_lse() if torch.distributed.get_rank() == 0 else contextlib.nullcontext():
            alone.forward(batch)
    # Exchange off (OpenRLHF: each rank decides per call whether zorro serves it): rank 1 never makes
    # the call, as when it hands its micro-batch back; rank 0 checks alone and nothing waits for rank 1.
    local = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    local.self_check.exchange = False
    if torch.distributed.get_rank() == 0:
        with warnings.catch_warnings(), wrong_head_lse():
            warnings.simplefilter("ignore")
            local.forward(batch)
    torch.distributed.barrier()  # the ranks still meet at the next collective
    return {
        "local": local.self_check.metric(),
        "alone": (alone.self_check.metric(), [str(w.message) for w in caught_alone]),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, SelfCheckWarning)],
        "metric": actor.self_check.metric(),
        "verdicts": {k: v.passed for k, v in actor.self_check.verdicts.items()},
        "spec": actor.self_check.spec.backend if actor.self_check.spec else None,
        "lp_error": max_abs_error(out.log_probs, lp_ref),
        "grad_error": max_rel_grad_error(grads, grads_ref)[0],
    }


def test_a_planted_wrong_gradient_kernel_is_caught_on_two_ranks_which_agree_and_fall_back():
    ranks = launch(_planted_rank, 2, 0, timeout_s=300)
    for r in ranks:
        assert r["metric"] == 0.0 and r["spec"] == "sdpa"
        assert r["verdicts"] == {
            ("split", "flash_cpu", "sdpa", "float64", "PromptPlan"): False,
            ("split", "sdpa", "sdpa", "float64", "PromptPlan"): True,
        }
        (message,) = r["warnings"]  # once, with the numbers
        assert "self-check failed, flash_cpu" in message and "gradient error" in message
        assert "Falling back for the rest of the run to split mode on sdpa" in message
        # after falling back: the float64 reference's log-probs and gradients
        assert r["lp_error"] <= tolerances.LOGPROB_ATOL
        assert r["grad_error"] <= tolerances.GRAD_RTOL
    for rank, r in enumerate(ranks):  # one rank's wrong kernel: both fall back
        metric, (message,) = r["alone"]
        assert metric == 0.0 and "self-check failed" in message
        assert ("self-check failed, on rank 0, flash_cpu" in message) == (rank == 1)  # rank 0's, by its figures
        assert "gradient error" in message and "model." in message  # the worst parameter by name, from either rank
    assert [r["local"] for r in ranks] == [0.0, None]  # per-rank verdicts: rank 0 fell back, rank 1 ran none


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_rule_passes_a_right_backend_and_catches_the_planted_one(dtype):
    model = build_model(preset_config("tiny-qwen3"), dtype=getattr(torch, dtype))
    right = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    right.forward(_batch(model))
    assert right.self_check.metric() == 1.0
    wrong = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    with wrong_head_lse(), pytest.warns(SelfCheckWarning, match="self-check failed"):
        wrong.forward(_batch(model))
    verdict = wrong.self_check.failed
    assert verdict is not None and verdict.grad_error > 3 * verdict.grad_allowed


def test_the_trainers_metrics_carry_it():
    from zorro_core.integrations.openrlhf.status import CallStats, status_entries
    from zorro_core.integrations.verl.metrics import MicroBatchStats, add_metrics

    stats = [MicroBatchStats(True, 4, 2, 8, 6)]
    assert add_metrics({}, stats, 0.0)["metrics"]["zorro/self_check"] == [0.0]
    assert "zorro/self_check" not in add_metrics({}, stats)["metrics"]  # absent when no check ran
    calls = CallStats()
    calls.served(torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), torch.tensor([[1]]))
    assert "zorro/self_check" not in status_entries(calls)
    calls.self_check = 1.0
    assert status_entries(calls)["zorro/self_check"] == 1.0
    assert calls.take().self_check == 1.0 and calls.self_check is None


def test_a_sharded_model_is_not_checked_and_says_so(monkeypatch):
    monkeypatch.setattr(self_check, "sharded", lambda model: "the model's parameters are sharded (FSDP)")
    model = _model()
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    with pytest.warns(SelfCheckWarning, match="skipped: the model's parameters are sharded"):
        actor.forward(_batch(model))
    actor.forward(_batch(model))  # said once
    assert actor.self_check.metric() is None and not actor.self_check.verdicts


def test_zorro_env_and_verify_report_it():
    from zorro_cli.env import self_check_row
    from zorro_core.actor.config import ActorConfig
    from zorro_core.verify.gradients import VerifyCase, verify_cases

    assert self_check_row("cpu").startswith("pass: flash_cpu (split mode, sdpa, float32, PromptPlan)")
    case = VerifyCase(
        "tiny-qwen3", "float32", "padded", ActorConfig(attn_implementation="sdpa", varlen_backend="flash_cpu")
    )
    plain = VerifyCase(
        "tiny-qwen3", "float32", "padded", ActorConfig(attn_implementation="sdpa", varlen_backend="sdpa")
    )
    right, on_sdpa = verify_cases([case, plain])
    (broken,) = verify_cases([case], bug="positions_restart")
    assert right.status == "pass" and right.self_check.startswith("pass: flash_cpu")
    assert on_sdpa.self_check == ""  # CPU sdpa: not run (CI proves it)
    assert broken.status == "fail" and broken.self_check.startswith("fail: flash_cpu")


def test_the_checks_weights_follow_the_log_probs_device():
    """The batch may sit on another device than the model (the actor moves it): the check's token mask
    and weights follow the log-probs. An H200 run found the mask left on the batch's CPU device
    (QLoRA with a CPU batch: 'Expected all tensors to be on the same device'); meta stands in for CUDA."""
    param = torch.nn.Parameter(torch.ones(3, device="meta"))
    batch = create_dummy_batch(batch_size=2, num_unique_prompts=1, prompt_len=4, response_len=3, vocab_size=16, seed=0)

    class OnMeta:
        def run_route(self, batch, spec, dedup, temperature):
            return (param * 2)[None].expand(batch.batch_size, 3)

    lp, grads = self_check._run(OnMeta(), batch, None, True, 1.0, [("p", param)])
    assert lp.device.type == "meta" and grads[0].device.type == "meta" and grads[0].shape == param.shape


def test_a_kernel_that_raises_here_fails_its_check_and_the_run_falls_back(monkeypatch):
    """A kernel pair that cannot run on this device (flash-attn 2.7+'s changed calls crashed before
    #46) fails the check like a wrong one: one warning naming the error, then sdpa split mode, and the
    call's log-probs and gradients are the float64 reference's."""

    def forward(self, *args, **kwargs):
        raise TypeError("fwd() takes 21 positional arguments but 24 were given")

    monkeypatch.setattr(CpuFlashPair, "forward", forward)
    model = _model()
    batch = _batch(model)
    weights = token_weights(batch)
    lp_ref, _, grads_ref = per_sequence(model, batch, weights=weights, entropy=False)
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    with pytest.warns(SelfCheckWarning) as caught:
        out = actor.forward_backward(batch, lambda o, rows: (o.log_probs * weights[0][rows]).sum())
    (message,) = [str(c.message) for c in caught if c.category is SelfCheckWarning]
    assert "flash_cpu (split mode, sdpa, float64, PromptPlan) raised TypeError: fwd() takes 21" in message
    assert "Falling back for the rest of the run to split mode on sdpa" in message
    assert actor.self_check.metric() == 0.0 and actor.self_check.spec.backend == "sdpa"
    assert max_abs_error(out.log_probs, lp_ref) <= tolerances.LOGPROB_ATOL
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert max_rel_grad_error(grads, grads_ref)[0] <= tolerances.GRAD_RTOL


def test_the_plain_computation_raising_is_the_trainers_error(monkeypatch):
    """Nothing to fall back to after the plain computation: its own error reaches the caller."""
    model = _model()
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    monkeypatch.setattr(self_check, "fallback_of", lambda spec, dedup: None)

    def boom(*args, **kwargs):
        raise ValueError("the plain path broke")

    monkeypatch.setattr(actor, "run_route", boom)
    with pytest.raises(ValueError, match="the plain path broke"):
        actor.forward(_batch(model))


# ---------------------------------------------------------------- the model's own errors (#60 item 2)


class RaisesOnce:
    """A forward hook of the user's model that raises on `times` calls after its first `after` (then passes)."""

    def __init__(self, times: int = 1, after: int = 0) -> None:
        self.left, self.after = times, after

    def __call__(self, module, args, output):
        if self.after:
            self.after -= 1
        elif self.left:
            self.left -= 1
            raise RuntimeError("the model's own hook broke")


def test_the_models_transient_error_reaches_the_caller_and_the_check_runs_again():
    """A hook of the model raising once, in the check's first run of zorro's path: the error is the
    caller's (the plain computation would have met it as well), no verdict is recorded, nothing falls
    back, and the next call checks again and passes. Before: the check failed, blamed zorro's path and
    the run fell back to sdpa for good."""
    model = _model()
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    model.model.layers[0].register_forward_hook(RaisesOnce())
    with warnings.catch_warnings():
        warnings.simplefilter("error", SelfCheckWarning)
        with pytest.raises(RuntimeError, match="the model's own hook broke") as raised:
            actor.forward(_batch(model))
        assert "not a fault of zorro's path" in "\n".join(getattr(raised.value, "__notes__", []))
        assert not actor.self_check.verdicts and actor.self_check.failed is None
        actor.forward(_batch(model))  # checked again: passes
    assert actor.self_check.metric() == 1.0 and actor.self_check.spec is None


def test_the_models_error_in_the_plain_computation_alone_reaches_the_caller():
    """The hook raises in the check's plain computation (its second forward), not in zorro's path: the
    caller's error too, with no verdict; the next call checks again and passes."""
    model = _model()
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    model.model.layers[0].register_forward_hook(RaisesOnce(after=1))
    with pytest.raises(RuntimeError, match="the model's own hook broke") as raised:
        actor.forward(_batch(model))
    assert "the plain computation raised it (zorro's path did not)" in "\n".join(raised.value.__notes__)
    assert not actor.self_check.verdicts
    actor.forward(_batch(model))
    assert actor.self_check.metric() == 1.0 and actor.self_check.spec is None


def test_an_error_the_plain_computation_also_raises_is_the_callers_every_time():
    model = _model()
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    model.model.layers[0].register_forward_hook(RaisesOnce(times=1000))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the model's own hook broke") as raised:
            actor.forward(_batch(model))
        assert "the plain computation raises it too" in "\n".join(raised.value.__notes__)
    assert actor.self_check.metric() is None and actor.self_check.failed is None and actor.self_check.spec is None


def test_a_nan_weight_is_not_blamed_on_zorro():
    """NaN in the model's weights: the plain computation's log-probs are NaN too, so the check judges
    nothing, says so (the model's values, not zorro's path), records nothing and does not fall back; once
    the weight is finite again the next call checks and passes."""
    model = _model()
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    weight = model.model.norm.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0] = float("nan")
    with pytest.warns(SelfCheckWarning) as caught:
        out = actor.forward(_batch(model))
    (message,) = [str(c.message) for c in caught]
    assert "not judged" in message and "the plain computation itself" in message
    assert "not a fault of zorro's path" in message and "self-check failed" not in message
    assert out.log_probs.isnan().any()  # the model's own NaN, as the plain computation gives it
    assert not actor.self_check.verdicts and actor.self_check.spec is None and actor.self_check.metric() is None
    with torch.no_grad():
        weight.copy_(saved)
    actor.forward(_batch(model))
    assert actor.self_check.metric() == 1.0 and actor.self_check.spec is None


# ---------------------------------------------------------------- ranks: the setting agreed, reasons reported


@contextlib.contextmanager
def kernel_raises():
    """The flash_cpu pair's forward cannot run here (as flash-attn 2.7's changed calls crashed before #46)."""
    original = CpuFlashPair.forward

    def forward(self, *args, **kwargs):
        raise TypeError("fwd() takes 21 positional arguments but 24 were given")

    CpuFlashPair.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        CpuFlashPair.forward = original  # type: ignore[method-assign]


def _ranks_disagree() -> dict:
    rank = torch.distributed.get_rank()
    model = _model()
    batch = _batch(model)
    out: dict = {}
    # Only rank 0's kernel raises: rank 1 passes its own check and takes rank 0's verdict, with its reason.
    actor = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    with warnings.catch_warnings(record=True) as caught, kernel_raises() if rank == 0 else contextlib.nullcontext():
        warnings.simplefilter("always")
        actor.forward(batch)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, SelfCheckWarning)]
    out["spec"] = actor.self_check.spec.backend if actor.self_check.spec else None
    # Rank 1 built with self_check=False beside rank 0 with it on: before, rank 0 waited in the verdict
    # exchange until rank 1's process ended; now it refuses at once, naming the setting and the ranks.
    # Rank 1 runs its call (it checks nothing, so it waits for nobody: it learns nothing either).
    mixed = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=rank == 0)
    for _ in range(2):  # refused at every call: a second one would still wait in the exchange
        try:
            mixed.forward(batch)
            out["mixed"] = "ran"
        except ValueError as e:
            out["mixed"] = str(e)
    # An actor one rank uses alone (as rank 0's evaluation), its exchange off as the error says: the
    # ranks' later actors still meet in their exchanges.
    if rank == 0:
        alone = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=False)
        alone.self_check.exchange = False
        alone.forward(batch)
    torch.distributed.barrier()
    # The same setting on every rank, after that: the ranks still check together.
    both = DeduplicatedActor(model=model, varlen_backend="flash_cpu", self_check=True)
    both.forward(batch)
    out["rank_alone"] = "ran" if both.self_check.metric() == 1.0 else both.self_check.metric()
    torch.distributed.barrier()
    return out


def test_ranks_agree_on_the_setting_and_report_each_others_failure_by_its_reason():
    ranks = launch(_ranks_disagree, 2, timeout_s=120)
    for rank, r in enumerate(ranks):
        (message,) = r["warnings"]
        assert r["spec"] == "sdpa" and "self-check failed" in message
        assert "raised TypeError: fwd() takes 21 positional arguments" in message, message
        assert ("on rank 0" in message) == (rank == 1)
    mixed = ranks[0]["mixed"]
    assert "ActorConfig.self_check" in mixed and "on on rank(s) [0] and off on rank(s) [1]" in mixed
    assert ranks[1]["mixed"] == "ran"
    assert all(r["rank_alone"] == "ran" for r in ranks)
