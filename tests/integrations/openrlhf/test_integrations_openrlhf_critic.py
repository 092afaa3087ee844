"""zorro's critic (`serve_critic`) against OpenRLHF 0.11.2's own critic, float64, one process.

OpenRLHF's critic is built by its own `get_llm_for_sequence_regression(path, "critic", ...)` (its CriticModel:
the base model plus the `score` value head); the served copy holds the same weights. Checked on OpenRLHF-layout
micro-batches (groups of 3/1/2/1, one prompt seen again, a one-token response), packed and unpacked, right- and
left-padded, with and without `normalize_reward`: the action values and every parameter's gradient of a loss
weighting each value at random equal OpenRLHF's critic forward and an independent reference (each row alone
through the unmodified base model and value head, unpadded). Runs in OpenRLHF's venv (.ci/openrlhf_tests).
"""

import copy
import warnings

import pytest
import torch
from openrlhf_setup import LAYOUTS, OPENRLHF_MISSING, samples, save_tiny

from zorro_core.verify.reference import max_rel_grad_error
from zorro_core.verify.tolerances import GRAD_RTOL, LOGPROB_ATOL

pytestmark = pytest.mark.skipif(OPENRLHF_MISSING is not None, reason=OPENRLHF_MISSING or "")

if OPENRLHF_MISSING is None:
    from openrlhf.models import get_llm_for_sequence_regression

    from zorro_core.integrations.layout import DedupFallbackWarning
    from zorro_core.integrations.openrlhf import critic as zc

# The project's float64 floors (zorro_core.verify.tolerances: measured ~6e-8 / ~6e-7 with margin), values
# relative to their largest magnitude (a value head's scale is arbitrary, a log-prob's is not); OpenRLHF's
# critic casts nothing, so both sides run in float64. Measured: values <= 9.3e-8 relative (eager; sdpa 1.5e-16),
# gradients <= 2.4e-7, as OpenRLHF's own packed path differs from its unpacked one.
VALUE_RTOL = LOGPROB_ATOL


def rel_err(v, ref):
    return ((v - ref).abs().max() / ref.abs().max()).item()


ATTN = {"right_padded": "eager", "left_padded": "sdpa"}  # why sdpa for left padding: test_integrations_openrlhf.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(str(tmp_path_factory.mktemp("openrlhf_critic") / "tiny-qwen3"))


def make_critic(path, attn="eager", packed=False, normalize=False):
    """OpenRLHF's critic, by its own builder, in float64; the value head drawn from a fixed seed."""
    critic = get_llm_for_sequence_regression(
        path, "critic", param_dtype="bf16", attn_implementation=attn, packing_samples=packed, normalize_reward=normalize
    )
    critic.to(torch.float64)
    with torch.no_grad():
        head = getattr(critic, critic.value_head_prefix)
        head.weight.copy_(
            torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        )
        if normalize:
            critic.mean.fill_(0.3)
            critic.std.fill_(1.7)
    return critic


def run(critic, seq, att, act, seed=1, return_output=False):
    critic.zero_grad(set_to_none=True)
    values = critic(seq, act, att, return_output=return_output)
    if return_output:
        values, output = values
        assert output.aux_loss is None
    loss = (values * torch.randn(values.shape, generator=torch.Generator().manual_seed(seed), dtype=values.dtype)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
    return values.detach(), grads


def plain_values(critic, seq, att, act):
    """The independent reference: each row alone through the unmodified base model and value head, unpadded."""
    base, head = getattr(critic, critic.base_model_prefix), getattr(critic, critic.value_head_prefix)
    out = torch.zeros(act.shape, dtype=torch.float64)
    t, a = seq.shape[1], act.shape[1]
    with torch.no_grad():
        for i in range(seq.shape[0]):
            real = att[i].bool().nonzero().flatten()
            v = head(base(seq[i, real][None]).last_hidden_state)[0, :, 0]
            if critic.normalize_reward:
                v = (v - critic.mean) / critic.std
            for col in range(a):
                j = t - 1 - a + col  # column j: the value at token j
                if act[i, col]:
                    out[i, col] = v[int((real == j).nonzero())]
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_equals_openrlhf_critic(ckpt, layout, packed, normalize):
    seq, att, act = LAYOUTS[layout](samples())
    ref = make_critic(ckpt, ATTN[layout], packed, normalize)
    ded = zc.serve_critic(copy.deepcopy(ref))
    assert type(ded).__name__ == type(ref).__name__ and isinstance(ded, type(ref))
    assert [n for n, _ in ded.named_parameters()] == [n for n, _ in ref.named_parameters()]
    ref_v, ref_grads = run(ref, seq, att, act)
    v, grads = run(ded, seq, att, act, return_output=True)  # the training call's form
    assert ded.zorro_calls == {"dedup": 1, "fallback": 0}
    assert v.dtype == ref_v.dtype == torch.float64 and v.shape == ref_v.shape == act.shape
    assert torch.all(v[~act.bool()] == 0)
    err = rel_err(v, ref_v)
    plain_err = rel_err(v, plain_values(ded, seq, att, act))
    g_err, name = max_rel_grad_error(grads, ref_grads)
    print(f"{layout} packed={packed} normalize={normalize}: values {err:.1e}, plain {plain_err:.1e}, grad {g_err:.1e}")
    assert err <= VALUE_RTOL, f"value error {err:.2e} (relative) against OpenRLHF's critic"
    assert plain_err <= VALUE_RTOL, f"value error {plain_err:.2e} (relative) against the per-row float64 forward"
    assert len(grads) == len(ref_grads) == len(list(ded.parameters()))
    assert g_err <= GRAD_RTOL, f"gradient of {name} off by {g_err:.2e} relative"
    assert ded.zorro_stats.computed_prompt_tokens < ded.zorro_stats.prompt_tokens  # each prompt once


def test_planted_bug_fails(ckpt, monkeypatch):
    """Values read one position late (the response token itself, not the one before) must fail by far."""
    seq, att, act = LAYOUTS["right_padded"](samples())
    ref = make_critic(ckpt)
    ded = zc.serve_critic(copy.deepcopy(ref))
    real = zc.DeduplicatedActor.response_hidden

    def late(self, batch):
        hidden, plan = real(self, batch)
        return torch.cat([hidden[1:], hidden[-1:]]), plan

    monkeypatch.setattr(zc.DeduplicatedActor, "response_hidden", late)
    ref_v, ref_grads = run(ref, seq, att, act)
    v, grads = run(ded, seq, att, act)
    assert rel_err(v, ref_v) > 1e-2 and max_rel_grad_error(grads, ref_grads)[0] > 1e-3


def test_gradient_checkpointing_and_eval_call(ckpt):
    """OpenRLHF's critic setup (gradient checkpointing in training) and its no-grad eval call: equal."""
    seq, att, act = LAYOUTS["right_padded"](samples(seed=2))
    ref = make_critic(ckpt)
    ded = zc.serve_critic(copy.deepcopy(ref))
    for c in (ref, ded):
        c.gradient_checkpointing_enable()
        c.train()
    ref_v, ref_grads = run(ref, seq, att, act)
    v, grads = run(ded, seq, att, act)
    assert rel_err(v, ref_v) <= VALUE_RTOL and max_rel_grad_error(grads, ref_grads)[0] <= GRAD_RTOL
    for c in (ref, ded):
        c.eval()
    with torch.no_grad():
        assert rel_err(ded(seq, act, att), ref(seq, act, att)) <= VALUE_RTOL
    assert ded.zorro_calls == {"dedup": 2, "fallback": 0}


def test_fallbacks_run_openrlhf(ckpt):
    """What is not served runs OpenRLHF's own forward, warned once with the reason."""
    seq, att, act = LAYOUTS["right_padded"](samples())
    ded = zc.serve_critic(make_critic(ckpt))
    with pytest.warns(DedupFallbackWarning, match="without action_mask"):
        out = ded(seq, None, att, return_output=True)
    assert "last_hidden_state" in out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ded(seq, act, att)  # served: no warning
    none = torch.zeros_like(act)
    with pytest.warns(DedupFallbackWarning, match="no token of the call is scored"):
        ded(seq, none, att)
    assert ded.zorro_calls == {"dedup": 1, "fallback": 2}
    with pytest.raises(TypeError, match="not OpenRLHF 0.11's critic"):
        zc.serve_critic(torch.nn.Linear(2, 1))
    assert zc.serve_critic(ded) is ded and zc.dedup_critic_class(type(ded)) is type(ded)
