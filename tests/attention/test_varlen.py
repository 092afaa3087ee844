"""Varlen attention backends against a naive per-segment loop (and, on CUDA, against each other)."""

import pytest
import torch

from zorro_core.attention.backends import BACKENDS, backend_unavailable
from zorro_core.plan.segments import Segments, cu_seqlens

TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def naive(q, k, v, lens_q, lens_k, scale, window=None):
    """One segment at a time, every score written out: bottom-right causal, optional window."""
    outs, oq, ok = [], 0, 0
    rep = q.shape[1] // k.shape[1]
    for lq, lk in zip(lens_q, lens_k):
        qs, ks, vs = q[oq : oq + lq].double(), k[ok : ok + lk].double(), v[ok : ok + lk].double()
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        out = torch.zeros(lq, q.shape[1], q.shape[2], dtype=torch.float64)
        for i in range(lq):
            qa = i + lk - lq
            keys = [j for j in range(lk) if j <= qa and (window is None or qa - j < window)]
            s = torch.einsum("hd,khd->hk", qs[i], ks[keys]) * scale
            out[i] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), vs[keys])
        outs.append(out)
        oq, ok = oq + lq, ok + lk
    return torch.cat(outs)


def segments(lens_q, lens_k, device="cpu"):
    lq, lk = torch.tensor(lens_q), torch.tensor(lens_k)
    tq, tk = int(lq.sum()), int(lk.sum())
    return Segments(
        0,
        torch.arange(tk),
        cu_seqlens(lq).to(device),
        cu_seqlens(lk).to(device),
        max(lens_q),
        max(lens_k),
        lens_q == lens_k,
        tq,
        tk,
    )


CASES = {
    "self_causal": ([5, 1, 9], [5, 1, 9]),
    "cross": ([3, 1, 4], [10, 6, 4]),  # queries are the tail of their keys
    "single": ([7], [12]),
}


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_backends_match_naive(backend, case, window, dtype):
    lens_q, lens_k = CASES[case]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), 4, 8, generator=g, dtype=dtype)
    k = torch.randn(sum(lens_k), 2, 8, generator=g, dtype=dtype)  # GQA: 2 query heads per kv head
    v = torch.randn(sum(lens_k), 2, 8, generator=g, dtype=dtype)
    out = BACKENDS[backend].varlen(q, k, v, segments(lens_q, lens_k), 8**-0.5, window)
    ref = naive(q, k, v, lens_q, lens_k, 8**-0.5, window)
    assert out.shape == q.shape and out.dtype == dtype
    assert (out.double() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("name", ["reference", "sdpa"])
def test_backend_gradients_match_naive(name):
    lens_q, lens_k = CASES["cross"]
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(n, h, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for n, h in ((sum(lens_q), 4), (sum(lens_k), 2), (sum(lens_k), 2))
    )
    w = torch.randn(sum(lens_q), 4, 8, generator=g, dtype=torch.float64)
    grads = []
    for fn in (
        lambda: BACKENDS[name].varlen(q, k, v, segments(lens_q, lens_k), 0.3),
        lambda: naive(q, k, v, lens_q, lens_k, 0.3),
    ):
        grads.append(torch.autograd.grad((fn() * w).sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert (a - b).abs().max().item() < 1e-12


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_backends_match_reference(backend, dtype):
    why = backend_unavailable(backend, "cuda" if torch.cuda.is_available() else "cpu")
    if why:
        pytest.skip(why)
    lens_q, lens_k = CASES["cross"]
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lens_q), 4, 64, generator=g).to("cuda", dtype)
    k = torch.randn(sum(lens_k), 2, 64, generator=g).to("cuda", dtype)
    v = torch.randn(sum(lens_k), 2, 64, generator=g).to("cuda", dtype)
    seg = segments(lens_q, lens_k, "cuda")
    out = BACKENDS[backend].varlen(q, k, v, seg, 0.125)
    ref = BACKENDS["reference"].varlen(q.double(), k.double(), v.double(), seg, 0.125)
    assert (out.double() - ref).abs().max().item() < TOL[dtype]


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
@pytest.mark.parametrize("window", [None, 3])
def test_cross_call_equals_varlen_over_each_segments_keys(backend, window):
    """The protocol's cross call (whole packed row in, the plan's layout picks the keys) equals the
    plain varlen call over each response's [prompt | itself] keys gathered by k_index."""
    from zorro_core import build_dedup_plan, create_dummy_batch

    batch = create_dummy_batch(
        batch_size=6, num_unique_prompts=2, prompt_len=9, response_len=5, vocab_size=50, vary_lengths=True, seed=3
    )
    plan = build_dedup_plan(batch)
    seg = plan.cross
    g = torch.Generator().manual_seed(4)
    t = plan.num_tokens
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    q_x = q[seg.q_start :]
    out = BACKENDS[backend].cross(q_x, k, v, seg, 0.3, window)
    ref = naive(q_x, k[seg.k_index], v[seg.k_index], seg.lens_q.tolist(), seg.lens_k.tolist(), 0.3, window)
    assert out.shape == q_x.shape
    assert (out - ref).abs().max().item() < TOL[torch.float64]


def _cross_case():
    from zorro_core import build_dedup_plan, create_dummy_batch

    batch = create_dummy_batch(
        batch_size=6, num_unique_prompts=2, prompt_len=9, response_len=5, vocab_size=50, vary_lengths=True, seed=3
    )
    plan = build_dedup_plan(batch)
    g = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(plan.num_tokens, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)
    )
    return plan.cross, q, k, v


def _cross_run(seg, q, k, v, window):
    q_x = q[seg.q_start :]
    out = BACKENDS["sdpa"].cross(q_x, k, v, seg, 0.3, window)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)
    return out.detach(), torch.autograd.grad((out * w).sum(), (q, k, v))


def test_cpu_flash_kernel_passes_its_probe_here():
    """On the torch installed here the private CPU flash kernel agrees with float64 attention (the
    fast cross call is the one that runs); a kernel called wrongly fails the probe with the reason."""
    from zorro_core.attention import padded

    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert padded.cpu_flash_unavailable(dtype) is None, dtype
    real = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    swapped = padded.probe_cpu_flash(torch.float32, forward_op=lambda q, k, v, *a, **kw: real(q, v, k, *a, **kw))
    assert swapped is not None and "differs from float64 softmax attention" in swapped
    assert "TypeError" in padded.probe_cpu_flash(torch.float32, backward_op=lambda *a: None)


@pytest.mark.parametrize("reentrant", [False, True])
def test_cpu_flash_probe_inside_a_checkpointed_region(reentrant):
    """The probe may first run inside a checkpointed layer (forward or its recompute in backward):
    it records no autograd graph, so checkpointing's saved-tensor hooks never see its tensors."""
    from torch.utils.checkpoint import checkpoint

    from zorro_core.attention import padded

    seen = []

    def layer(x):
        seen.append(padded.probe_cpu_flash(torch.float32))
        return (x * 2).sin()

    x = torch.randn(4, generator=torch.Generator().manual_seed(8), requires_grad=True)
    checkpoint(layer, x, use_reentrant=reentrant).sum().backward()
    assert seen == [None, None]  # forward and recompute
    assert torch.allclose(x.grad, 2 * (2 * x.detach()).cos())


@pytest.mark.parametrize("window", [None, 3])
def test_cross_call_falls_back_to_the_public_path_when_the_probe_fails(monkeypatch, window):
    """The probe forced to fail: the CPU cross call runs F.scaled_dot_product_attention over the
    [prompt | own] blocks (the private kernel is not called), equal to the float64 reference and,
    in output and gradients, to the fast path."""
    from zorro_core.attention import padded

    seg, q, k, v = _cross_case()
    fast_out, fast_grads = _cross_run(seg, q, k, v, window)
    monkeypatch.setattr(padded, "cpu_flash_unavailable", lambda dtype: "forced by the test")

    def refuse(*args):
        raise AssertionError("the private kernel ran although its probe failed")

    monkeypatch.setattr(padded._FlashCross, "apply", refuse)
    out, grads = _cross_run(seg, q, k, v, window)
    q_x = q[seg.q_start :]
    ref = naive(q_x, k[seg.k_index], v[seg.k_index], seg.lens_q.tolist(), seg.lens_k.tolist(), 0.3, window)
    assert (out - ref).abs().max().item() < TOL[torch.float64]
    assert (out - fast_out).abs().max().item() < TOL[torch.float64]
    for a, b in zip(grads, fast_grads):
        assert (a - b).abs().max().item() < TOL[torch.float64]


def test_trie_cross_calls_fall_back_to_the_public_path_when_the_probe_fails(monkeypatch):
    """sharing="prefix": every level's cross call takes the same probed route; forced to the public
    path it equals the fast path and the exact reference backend, in output and gradients."""
    from zorro_core import RolloutBatch
    from zorro_core.attention import padded
    from zorro_core.attention.tree import tree_split_attention
    from zorro_core.plan.trie import build_trie_plan

    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    batch = RolloutBatch.from_lists([a, a + [1, 2], a[:4] + b, b, a], [[3, 4], [5], [6, 7, 8], [9, 1], [2, 2, 2]])
    plan = build_trie_plan(batch, min_shared_tokens=1)
    assert len(plan.levels) > 2  # cross calls at two levels at least
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(plan.num_tokens, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)
    )
    w = torch.randn(plan.num_tokens, 4, 8, generator=g, dtype=torch.float64)

    def run(backend):
        out = tree_split_attention(plan, q, k, v, 0.3, None, backend)
        return out.detach(), torch.autograd.grad((out * w).sum(), (q, k, v))

    fast, exact = run("sdpa"), run("reference")
    monkeypatch.setattr(padded, "cpu_flash_unavailable", lambda dtype: "forced by the test")
    monkeypatch.setattr(padded._FlashCross, "apply", lambda *a: pytest.fail("the private kernel ran"))
    fallback = run("sdpa")
    for other in (fast, exact):
        assert (fallback[0] - other[0]).abs().max().item() < TOL[torch.float64]
        for x, y in zip(fallback[1], other[1]):
            assert (x - y).abs().max().item() < TOL[torch.float64]
