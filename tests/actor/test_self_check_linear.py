"""The self-check on gated DeltaNet models (Qwen3-Next, Qwen3.5; #57 item 5): transformers' chunked delta
rule computes in float32 whatever the model's dtype, and zorro's paths start a response's chunks at its
prompt's end, so a right path differs from the plain computation by that kernel's float32 rounding (the
issue measured the schedule's check failing 6 of 8 seeds on a float64 Qwen3-Next exact to 2e-9). The
allowance now includes that noise, measured on the slice (the plain computation against itself with the
delta rule in float64): right paths pass on every seed, planted wrong gradients still fail."""

from __future__ import annotations

import pytest
import torch
from versions import QWEN3_NEXT_ADAPTABLE, QWEN3_NEXT_REASON

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.schedule import schedule_verdict
from zorro_core.actor.self_check import verdict_of
from zorro_core.attention import external_linear as linear_kept
from zorro_core.models.presets import build_model, preset_config
from zorro_core.plan.batch import create_dummy_batch

pytestmark = pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON)

LINEAR = ["tiny-qwen3-next", "tiny-qwen3.5"]
SEEDS = range(8)


def _actor(name: str, dtype: str, seed: int) -> tuple[DeduplicatedActor, object]:
    model = build_model(preset_config(name), dtype=getattr(torch, dtype), seed=seed)
    batch = create_dummy_batch(
        6, 2, prompt_len=12, response_len=6, vocab_size=model.config.vocab_size, vary_lengths=True, seed=seed
    )
    return DeduplicatedActor(model=model, self_check=True), batch


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", LINEAR)
def test_right_paths_pass_on_every_seed(name, dtype):
    """The schedule's check and forward's (the dedup path's), 8 models and batches each: before the fix
    the schedule's failed Qwen3-Next float64 on seeds 0 and 3 here, forward's on seeds 0 and 4."""
    failed = []
    for seed in SEEDS:
        actor, batch = _actor(name, dtype, seed)
        for which, verdict in (("schedule", schedule_verdict(actor, batch)), ("forward", verdict_of(actor, batch))):
            if not verdict.passed:
                failed.append(f"seed {seed}, {which}: {verdict.describe()}")
    assert not failed, "\n".join(failed)


class _NoWindowGrad:
    """Planted: phase 3 drops the kept conv windows' gradients (the prompts' conv inputs get none
    from the responses)."""

    real = staticmethod(linear_kept.InjectGrad.apply)

    @staticmethod
    def apply(out, window, state, kept, layer):
        return _NoWindowGrad.real(out, window.detach(), state, kept, layer)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("bug", ["no_window_grad", "no_state_grad"])
@pytest.mark.parametrize("name", LINEAR)
def test_a_planted_wrong_gradient_still_fails(monkeypatch, name, bug, dtype):
    """Wrong gradients through the kept state of a gated DeltaNet layer: the conv windows' dropped, or
    the delta-rule state's (the prompts' graph gets none of the responses' gradient through it)."""
    if bug == "no_window_grad":
        monkeypatch.setattr(linear_kept, "InjectGrad", _NoWindowGrad)
    else:
        real = linear_kept.InjectGrad.apply

        class NoStateGrad:
            @staticmethod
            def apply(out, window, state, kept, layer):
                return real(out, window, state.detach(), kept, layer)

        monkeypatch.setattr(linear_kept, "InjectGrad", NoStateGrad)
    actor, batch = _actor(name, dtype, 0)
    verdict = schedule_verdict(actor, batch)
    assert not verdict.passed and verdict.grad_error > 10 * verdict.grad_allowed, verdict.describe()


def test_the_float64_delta_rule_takes_fla_s_packed_calls():
    """The check's float64 delta rule (`_float64_delta_rule`) in fla's convention (one packed row with
    cu_seqlens, initial and final states per segment: what the adapter passes on CUDA with fla) equals it
    row by row in transformers' (right-padded rows)."""
    from zorro_core.actor.self_check import _float64_delta_rule

    gen = torch.Generator().manual_seed(0)
    lens, hk, hv, dk, dv = [5, 70, 9], 2, 4, 8, 6

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(1, sum(lens), hk, dk), rand(1, sum(lens), hk, dk), rand(1, sum(lens), hv, dv)
    g, beta = -rand(1, sum(lens), hv).abs(), rand(1, sum(lens), hv).sigmoid()
    init = rand(len(lens), hv, dk, dv)
    common = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    cu = torch.tensor([0, 5, 75, 84])
    out, state = _float64_delta_rule(q, k, v, g=g, beta=beta, initial_state=init, cu_seqlens=cu, **common)
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        row = [x[:, a:b] for x in (q, k, v, g, beta)]
        want, want_state = _float64_delta_rule(*row[:3], g=row[3], beta=row[4], initial_state=init[i : i + 1], **common)
        assert (out[:, a:b] - want).abs().max() < 1e-12 and (state[i] - want_state[0]).abs().max() < 1e-12


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", LINEAR)
def test_right_paths_pass_on_32_seeds_with_margin(name, dtype, capsys):
    """The measurement behind the rule (docs/correctness.md): 32 seeds, each check's err/allowed (the
    larger of the log-prob's and the worst gradient's); printed with -s. Run: pytest -m slow -s <this>."""
    ratios: dict[str, list[float]] = {"schedule": [], "forward": []}
    for seed in range(32):
        actor, batch = _actor(name, dtype, seed)
        for which, v in (("schedule", schedule_verdict(actor, batch)), ("forward", verdict_of(actor, batch))):
            assert v.passed, f"seed {seed}, {which}: {v.describe()}"
            ratios[which].append(max(v.logprob_error / v.logprob_allowed, v.grad_error / v.grad_allowed))
    with capsys.disabled():
        for which, rs in ratios.items():
            rs.sort()
            print(f"\n{name} {dtype} {which}: 32 seeds, err/allowed median {rs[16]:.3f} max {rs[-1]:.3f}")
