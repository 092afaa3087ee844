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
