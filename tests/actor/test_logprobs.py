"""Log-prob modes none / compute / memory: each against the per-sequence float64 reference,
against each other in float32, and the memory mode's autograd function on its own."""

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, mixed_batch
from torch import nn

from zorro_core import DeduplicatedActor, create_dummy_batch
from zorro_core.actor.logprobs import ChunkedLogProbs, chunk_size_for_budget, response_logprobs
from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

F32_LP_ATOL = 2e-5  # float32, mode vs mode (measured: log-prob 4.8e-7, entropy 3.3e-6, grads 8.7e-7 rel)
F32_GRAD_RTOL = 1e-5
MODES = ["none", "compute", "memory"]
TEMPERATURE = 0.7


# memory mode: chunks of 4 (ragged last chunk), of 1, and from a budget (one chunk here).
MEMORY_SETTINGS = {
    "chunk4": dict(logits_chunk_size=4),
    "chunk1": dict(logits_chunk_size=1),
    "budget": dict(logits_memory_budget_mib=1.0),
}


@pytest.fixture(scope="module")
def reference(tiny_models):
    cache = {}

    def get(tied):
        if tied not in cache:
            model = tiny_models("tiny-qwen3", tie_word_embeddings=tied)
            batch = mixed_batch()
            w = token_weights(batch, seed=11)
            cache[tied] = (model, batch, w, per_sequence(model, batch, TEMPERATURE, w))
        return cache[tied]

    return get


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("mode,setting", [("none", None), ("compute", None)] + [("memory", k) for k in MEMORY_SETTINGS])
def test_mode_matches_per_sequence_float64(reference, tied, mode, setting):
    model, batch, w, (ref_lp, ref_ent, ref_grads) = reference(tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    actor = DeduplicatedActor(model=model, logits_mode=mode, **MEMORY_SETTINGS.get(setting, {}))
    lp, ent, grads, _ = actor_run(actor, batch, TEMPERATURE, w)
    assert lp.dtype == torch.float64 and torch.all(lp[~batch.response_mask.bool()] == 0)
    assert (lp - ref_lp).abs().max().item() < LP_ATOL
    assert (ent - ref_ent).abs().max().item() < LP_ATOL
    err, name = max_rel_grad_error(grads, ref_grads)
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


@pytest.fixture(scope="module")
def float32_runs():
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3", vocab_size=512), dtype=torch.float32, attn_implementation="sdpa")
    batch = create_dummy_batch(
        batch_size=6, num_unique_prompts=2, prompt_len=20, response_len=12, vocab_size=512, vary_lengths=True, seed=21
    )
    w = token_weights(batch, seed=12)
    runs = {}
    for mode in MODES:
        actor = DeduplicatedActor(model=model, logits_mode=mode, logits_chunk_size=5)
        runs[mode] = actor_run(actor, batch, TEMPERATURE, w)[:3]
    return runs


@pytest.mark.parametrize("mode", ["none", "memory"])
def test_modes_agree_float32(float32_runs, mode):
    lp, ent, grads = float32_runs[mode]
    ref_lp, ref_ent, ref_grads = float32_runs["compute"]
    assert lp.dtype == torch.float32
    assert (lp - ref_lp).abs().max().item() < F32_LP_ATOL
    assert (ent - ref_ent).abs().max().item() < F32_LP_ATOL
    err, name = max_rel_grad_error(grads, ref_grads)
    assert err < F32_GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


def _head(bias: bool, dtype=torch.float64, vocab=13, hidden=6):
    torch.manual_seed(0)
    return nn.Linear(hidden, vocab, bias=bias).to(dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 50])
@pytest.mark.parametrize("outputs", ["both", "log_prob", "entropy"])
def test_chunked_function_gradcheck(bias, chunk, outputs):
    """float64 finite differences through the hand-written backward: hidden, weight, bias."""
    head = _head(bias)
    h = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (7,))

    def f(h, w, b):
        lp, ent = ChunkedLogProbs.apply(h, w, b, labels, TEMPERATURE, chunk, outputs != "log_prob")
        return {"both": (lp, ent), "log_prob": lp, "entropy": ent}[outputs]

    inputs = (h, head.weight, head.bias) if bias else (h, head.weight, None)
    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("bias", [False, True])
def test_memory_mode_equals_compute_with_bias_and_gather(bias):
    """response_logprobs on [T, H] with a repeated index: outputs and every gradient, float64."""
    head = _head(bias)
    hidden = torch.randn(9, 6, dtype=torch.float64)
    index = torch.tensor([0, 3, 3, 8, 2, 5])
    labels = torch.tensor([1, 12, 0, 5, 5, 7])
    wl, we = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    results = {}
    for mode in MODES:
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(h, head, index, labels, 1.7, True, mode, chunk_size=4)
        ((wl * lp).sum() + (we * ent).sum()).backward()
        results[mode] = [lp.detach(), ent.detach(), h.grad] + [p.grad for p in head.parameters()]
    for mode in ("none", "memory"):
        for got, want in zip(results[mode], results["compute"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_memory_mode_bfloat16_close_to_compute():
    head = _head(True, torch.bfloat16, vocab=300, hidden=32)
    h = torch.randn(40, 32, dtype=torch.bfloat16)
    labels = torch.randint(0, 300, (40,))
    index = torch.arange(40)
    out = {}
    for mode in ("compute", "memory"):
        hh = h.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        lp, ent = response_logprobs(hh, head, index, labels, TEMPERATURE, True, mode, chunk_size=7)
        (lp.sum() + ent.sum()).backward()
        out[mode] = (lp, ent, hh.grad, head.weight.grad)
    assert out["memory"][0].dtype == torch.float32
    for got, want in zip(out["memory"], out["compute"]):
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()


def test_memory_mode_frozen_head_and_no_grad():
    head = _head(True).requires_grad_(False)
    h = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (5,))
    lp, _ = response_logprobs(h, head, torch.arange(5), labels, 1.0, False, "memory", chunk_size=2)
    lp.sum().backward()
    assert head.weight.grad is None and h.grad is not None
    with torch.no_grad():
        lp2, ent2 = response_logprobs(h, head, torch.arange(5), labels, 1.0, True, "memory", chunk_size=2)
    assert not lp2.requires_grad and ent2.shape == (5,)
    torch.testing.assert_close(lp2, lp.detach())


def test_memory_mode_saves_no_vocab_sized_tensor():
    """What autograd keeps for backward: memory mode saves inputs and [N] statistics only."""
    vocab, n = 4096, 64
    head = _head(False, torch.float32, vocab=vocab, hidden=16)
    h = torch.randn(n, 16, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    for mode, expect_big in (("compute", True), ("memory", False)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t.numel()) or t, lambda t: t):
            response_logprobs(h, head, torch.arange(n), labels, 1.0, True, mode, chunk_size=8)
        assert (max(saved) >= n * vocab) == expect_big, (mode, max(saved))


def test_chunk_size_for_budget():
    # float32: per position 151,936 x (2 x 4 + 2 x 4) bytes = 2.32 MiB
    assert chunk_size_for_budget(151936, 256.0) == 110
    assert chunk_size_for_budget(151936, 256.0, torch.bfloat16) == 147
    assert chunk_size_for_budget(151936, 256.0, torch.float64) == 55
    assert chunk_size_for_budget(151936, 0.01) == 1
    with pytest.raises(ValueError, match="budget"):
        chunk_size_for_budget(151936, 0)


def test_bad_settings_raise(tiny_models):
    model = tiny_models("tiny-qwen3")
    with pytest.raises(ValueError, match="logits_memory_budget_mib"):
        DeduplicatedActor(model=model, logits_mode="memory", logits_memory_budget_mib=-1)
    with pytest.raises(ValueError, match="logits_mode"):
        DeduplicatedActor(model=model, logits_mode="tiled")
    head = _head(False)
    hidden, index, labels = torch.randn(3, 6, dtype=torch.float64), torch.arange(3), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk size"):
        response_logprobs(hidden, head, index, labels, 1.0, False, "memory", chunk_size=0)
    with pytest.raises(ValueError, match="temperature"):
        response_logprobs(hidden, head, index, labels, 0.0, False, "memory")
