"""The prompt-once schedule's attention through the kernel pairs (zorro_core.attention.region_varlen):
no dense mask and no [kept | own] copy, exact against the float64 per-sequence reference with every
micro-batch boundary splitting a group; through `flash_cpu` on CPU and through flash-attn's and
torch's real Python over the kernels' CPU emulation (tests/kernel_emulation); a planted bug fails."""

import copy
import functools

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, mixed_batch
from varlen_standins import Calls, install_flash_attn, install_torch_varlen

from tests.kernel_emulation.sdists import VERSIONS
from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.actor.schedule import prompt_once_step
from zorro_core.attention import external, region_varlen
from zorro_core.attention.kernels import CpuFlashPair
from zorro_core.stack.checkpointing import checkpointed
from zorro_core.verify.gradients import Errors, judge
from zorro_core.verify.reference import (
    actor_run,
    max_abs_error,
    max_rel_grad_error,
    per_sequence,
    rel_grad_errors,
    token_weights,
)

# mixed_batch's groups: a = rows 0, 3, 5 (prompt 0); c = rows 1, 4 (prompt 1); b = row 2 (prompt 2).
CUT_EVERY_BOUNDARY = [[0], [3], [5, 1], [4, 2]]
# Every part holds two prompts out of order (call B then runs through a permutation) and every
# boundary cuts a group.
INTERLEAVED = [[1, 0], [4, 3], [2, 5]]


def _loss_fn(weights):
    w_lp, w_ent = weights

    def loss_fn(out, rows):
        lp, ent = out.log_probs, out.entropy
        return (w_lp[rows].to(lp) * lp).sum() + (w_ent[rows].to(ent) * ent).sum()

    return loss_fn


def _schedule(model, batch, w, parts, backend="flash_cpu", flavour=None, temperature=0.7):
    actor = DeduplicatedActor(model=model, varlen_backend=backend)
    model.zero_grad(set_to_none=True)
    with checkpointed(model, flavour):
        res = prompt_once_step(actor, batch, _loss_fn(w), None, temperature, True, parts=parts)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return res, grads


@pytest.fixture
def no_dense(monkeypatch):
    """The dense masked call refused, and the flash_cpu pair's calls counted."""

    def dense(*a, **kw):
        raise AssertionError("the region ran its dense masked call")

    monkeypatch.setattr(external.KeyRegion, "_sdpa", dense)
    calls = {"forward": 0, "backward": 0}
    pair = CpuFlashPair()
    fwd, bwd = pair.forward, pair.backward

    def forward(*a, **kw):
        calls["forward"] += 1
        return fwd(*a, **kw)

    def backward(*a, **kw):
        calls["backward"] += 1
        return bwd(*a, **kw)

    pair.forward, pair.backward = forward, backward
    from zorro_core.attention import backends

    monkeypatch.setattr(backends.BACKENDS["flash_cpu"], "pair", pair)
    return calls


def _assert_exact(res, grads, ref):
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL
    assert (res.entropy - ref[1]).abs().max().item() < LP_ATOL
    err, name = max_rel_grad_error(grads, ref[2])
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


@pytest.mark.parametrize("parts", [CUT_EVERY_BOUNDARY, INTERLEAVED], ids=["in-order", "interleaved"])
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama", "tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_flash_cpu_exact_without_the_dense_call(tiny_models, per_sequence_reference, no_dense, name, parts):
    """GQA, MLA (qk 24, v 12) and MoE through the flash_cpu pair in float64: every layer's phase-1
    call and both phase-2 calls ran through the kernel, the dense call never."""
    model = tiny_models(name)
    batch, w, ref = per_sequence_reference(name, lambda: model, mixed_batch, 0.7, 3)
    res, grads = _schedule(model, batch, w, parts)
    layers = model.config.num_hidden_layers
    assert no_dense["forward"] == layers * (1 + 2 * len(parts))
    assert no_dense["backward"] == layers * (1 + 2 * len(parts))
    assert res.split_groups
    _assert_exact(res, grads, ref)


@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
def test_flash_cpu_exact_under_checkpointing(tiny_models, per_sequence_reference, no_dense, flavour):
    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    res, grads = _schedule(model, batch, w, INTERLEAVED, flavour=flavour)
    _assert_exact(res, grads, ref)


@pytest.mark.parametrize("name", ["tiny-qwen2-sliding", "tiny-gemma3"])
def test_a_window_that_cuts_a_prompt_keeps_the_dense_call(tiny_models, per_sequence_reference, name):
    """A window shorter than the 7-token prompt: those layers run the dense masked call, said once,
    and stay exact; Gemma 3's full layers run the kernel pair in the same forward."""
    model = tiny_models(name)
    batch, w, ref = per_sequence_reference(name, lambda: model, mixed_batch, 0.7, 3)
    region_varlen._warned.clear()
    with pytest.warns(RuntimeWarning, match=f"window {model.config.sliding_window}"):
        res, grads = _schedule(model, batch, w, INTERLEAVED)
    _assert_exact(res, grads, ref)


def test_a_window_longer_than_every_row_is_no_window(per_sequence_reference, no_dense):
    from zorro_core.models.presets import build_model, preset_config

    cfg = preset_config("tiny-qwen2-sliding", sliding_window=64)
    model = build_model(cfg, dtype=torch.float64, attn_implementation="eager", seed=0)
    batch, w, ref = per_sequence_reference("qwen2-window-64", lambda: model, mixed_batch, 0.7, 3)
    res, grads = _schedule(model, batch, w, INTERLEAVED)
    _assert_exact(res, grads, ref)


def test_a_planted_unmerged_lse_fails(tiny_models, per_sequence_reference, monkeypatch):
    """The comparison has teeth: a merge that keeps call A's lse (so each call's backward normalises
    by its own partial softmax, not the whole row's) leaves the forward right and the gradients far
    off."""
    model = tiny_models("tiny-qwen3")
    batch, w, ref = per_sequence_reference("tiny-qwen3", lambda: model, mixed_batch, 0.7, 3)
    real = region_varlen._merge_into

    def merge_keeping_own_lse(out, lse, part, part_lse):
        saved = lse.clone()
        real(out, lse, part, part_lse)
        lse.copy_(saved)

    monkeypatch.setattr(region_varlen, "_merge_into", merge_keeping_own_lse)
    res, grads = _schedule(model, batch, w, INTERLEAVED)
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL  # the forward is untouched
    err, _ = max_rel_grad_error(grads, ref[2])
    assert err > 1e-2


# --- the CUDA pairs' own Python over the kernels' CPU emulation, 16-bit, by verify's rule ----------

INSTALL = {
    "torch_varlen": install_torch_varlen,
    **{f"flash_attn-{v}": functools.partial(install_flash_attn, version=v) for v in VERSIONS},
}


@pytest.fixture(scope="module")
def reference64():
    from zorro_core.models.presets import build_model, preset_config

    m64 = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="eager", seed=0)
    batch = mixed_batch()
    w = token_weights(batch, seed=1)
    return m64, batch, w, per_sequence(m64, batch, 1.0, w)


def _schedule_errors(model, batch, w, ref, backend) -> Errors:
    res, grads = _schedule(model, batch, w, INTERLEAVED, backend=backend, temperature=1.0)
    return Errors(
        max_abs_error(res.log_probs, ref[0]), max_abs_error(res.entropy, ref[1]), rel_grad_errors(grads, ref[2])
    )


@pytest.mark.parametrize("name", list(INSTALL))
def test_cuda_pairs_through_their_own_python(reference64, kernel_emulation, monkeypatch, name):
    """bf16, GQA, every part interleaving two prompts: the schedule through each pair's real Python
    (flash-attn 2.6 / 2.7 / 2.8, torch's aten ops) over the emulated kernel, judged by verify's rule
    against the baseline actor on the same backend; the emulated kernel ran every call."""
    m64, batch, w, ref = reference64
    calls = Calls()
    INSTALL[name](kernel_emulation, monkeypatch, calls)
    monkeypatch.setattr(external.KeyRegion, "_sdpa", lambda *a, **kw: pytest.fail("dense call"))
    backend = name.split("-")[0]
    model = copy.deepcopy(m64).to(torch.bfloat16)
    lp, ent, grads, _ = actor_run(BaselineActor(model=model, varlen_backend=backend), batch, 1.0, w)
    base = Errors(max_abs_error(lp, ref[0]), max_abs_error(ent, ref[1]), rel_grad_errors(grads, ref[2]))
    calls.n = 0
    dedup = _schedule_errors(model, batch, w, ref, backend)
    assert calls.n == model.config.num_hidden_layers * (1 + 2 * len(INTERLEAVED))
    ratio, check, failing = judge("bfloat16", dedup, base)
    assert not failing, f"{check}: {failing[:3]}"
    assert dedup.log_prob < 0.2


def test_cuda_pair_planted_bug_fails(reference64, kernel_emulation, monkeypatch):
    """The same comparison fails when call B's backward reads other heads' lse rows (what a kernel
    that reads the lse from its data pointer gives for a strided block)."""
    m64, batch, w, ref = reference64
    install_flash_attn(kernel_emulation, monkeypatch, Calls())
    model = copy.deepcopy(m64).to(torch.bfloat16)
    lp, ent, grads, _ = actor_run(BaselineActor(model=model, varlen_backend="flash_attn"), batch, 1.0, w)
    base = Errors(max_abs_error(lp, ref[0]), max_abs_error(ent, ref[1]), rel_grad_errors(grads, ref[2]))
    real_backward = region_varlen.KeptAttention.backward

    def planted(ctx, dout):
        lay, pair = ctx.lay, ctx.pair

        class Rolled:  # call B's lse handed over with its head rows rolled
            @staticmethod
            def backward(dout_, q, k, v, out, lse, cu_q, *rest):
                if cu_q is lay.cu_q:
                    lse = lse.roll(1, 0).contiguous()
                return pair.backward(dout_, q, k, v, out, lse, cu_q, *rest)

        ctx.pair = Rolled()
        return real_backward(ctx, dout)

    monkeypatch.setattr(region_varlen.KeptAttention, "backward", staticmethod(planted))
    dedup = _schedule_errors(model, batch, w, ref, "flash_attn")
    assert (dedup.log_prob) < 0.2  # the forward is untouched
    assert judge("bfloat16", dedup, base)[2]
