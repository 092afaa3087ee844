"""The CUDA kernel pairs (zorro_core.attention.kernels) through the kernels' own Python: flash-attn's
real `flash_attn_interface` at 2.6.3, 2.7.4.post1 and 2.8.3.post2, and torch's real aten op calls,
over a CPU emulation of the compiled part that keeps its memory contract (tests/kernel_emulation:
lse read as a dense block from its data pointer, outputs written in place, the C++ checks, the
ngroups-swap decode shortcut, +inf lse for rows without keys). Each of issue #46's five defects has
a case here that fails without its fix; every comparison is against the float64 reference.
"""

import inspect
import warnings

import pytest
import torch

from tests.kernel_emulation.flash_core import Calls
from tests.kernel_emulation.sdists import VERSIONS
from zorro_core import RolloutBatch, build_dedup_plan
from zorro_core.attention import backends, merged
from zorro_core.attention.backends import BACKENDS, backend_unavailable, default_backend
from zorro_core.attention.hook import split_attention
from zorro_core.attention.kernels import FlashAttnPair, TorchFlashPair
from zorro_core.attention.merged import MergedSplitAttention, VarlenCall, merged_calls
from zorro_core.plan.segments import Segments, cu_seqlens

PAIRS = ["torch_varlen", *(f"flash_attn-{v}" for v in VERSIONS)]
# Relative error (max |err| / max |ref|) of a 16-bit kernel against float64: bf16 carries 8 bits
# (~4e-3 per rounding), fp16 11; a wrong lse gives errors of order 1 (issue #46: 13.9 to 60.9).
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _pair(emulation, name: str, calls=None):
    if name == "torch_varlen":
        emulation.aten(calls)
        return TorchFlashPair()
    version = name.split("-", 1)[1]
    return FlashAttnPair(interface=emulation.flash_attn(version, calls), version=version)


def _batch(prompts, responses) -> RolloutBatch:
    return RolloutBatch.from_lists(prompts, responses)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 50, (n,), generator=g).tolist()


def _qkv(t, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q64, k64, v64, g64 = (torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))
    return [x.to(dtype) for x in (q64, k64, v64)], g64.to(dtype)


def _grads(fn, q, k, v, g):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad((out.double() * g.double()).sum(), (q, k, v)))


def _assert_close_to_reference(plan, pair, qkv, g, scale=0.3):
    """The merged split path through `pair` on 16-bit inputs against the reference backend in
    float64 on the same (rounded) inputs: output and every gradient."""
    got = _grads(lambda q, k, v: merged.merged_split_attention(plan, q, k, v, scale, pair), *qkv, g)
    qkv64 = [x.double() for x in qkv]
    want = _grads(lambda q, k, v: split_attention(plan, q, k, v, scale, None, "reference"), *qkv64, g)
    tol = REL_TOL[qkv[0].dtype]
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), f"{what} has non-finite values"
        rel = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert rel < tol, f"{what}: relative error {rel:.3g} (tolerance {tol})"


def _prompt_plan():
    """Two groups sharing prompts (a self-causal call and a cross call), ragged lengths."""
    a, b = _tokens(7, 1), _tokens(4, 2)
    prompts = [a, a, a, b, b]
    responses = [_tokens(n, 10 + n) for n in (3, 5, 2, 6, 1)]
    return build_dedup_plan(_batch(prompts, responses))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", PAIRS)
def test_pair_through_the_real_interface_equals_the_reference(kernel_emulation, name, dtype):
    """Issue #46 items 1-3: the merged path with GQA (4 query heads, 2 K/V heads) and a cross call,
    so a later call's backward gets columns of the saved lse. Item 1 (a strided lse slice) gives
    gradients off by O(1) on every pair; item 2 (introspecting a CustomOpDef) raises on 2.7 and 2.8;
    item 3 (2.6's 8-tuple read as 2.7's) takes q as the lse on 2.6."""
    calls = Calls()
    pair = _pair(kernel_emulation, name, calls)
    if name.startswith("flash_attn-2.6"):
        assert inspect.isfunction(pair.interface._flash_attn_varlen_forward)
    elif name.startswith("flash_attn"):  # 2.7+ with torch >= 2.4: a torch.library custom op
        op = pair.interface._flash_attn_varlen_forward
        assert type(op).__name__ == "CustomOpDef" and not hasattr(op, "__name__")
    plan = _prompt_plan()
    assert len(merged_calls(plan)) == 2
    qkv, g = _qkv(plan.num_tokens, 4, 2, 16, dtype)
    _assert_close_to_reference(plan, pair, qkv, g)
    assert calls.n == 2  # both calls ran through the emulated kernel


@pytest.mark.parametrize("name", PAIRS)
def test_decode_shaped_call_with_an_empty_query_segment(kernel_emulation, name):
    """Issue #46 item 4: prompts [P1, P1, P2], responses of 4, 5, 2 tokens, prefix sharing with
    min_shared_tokens=1 gives an ancestor call with max_q = 1 and an empty query segment; with GQA
    the kernels' ngroups swap reshapes q as if total_q == batch and crashes. zorro passes
    max_seqlen_q >= 2 (exact: an upper bound), so the shortcut is never taken."""
    pair = _pair(kernel_emulation, name)
    p1, p2, r = _tokens(6, 3), _tokens(5, 4), _tokens(4, 5)
    # the 5-token response is the 4-token one and one more: that token is a trie level of its own
    plan = build_dedup_plan(_batch([p1, p1, p2], [r, [*r, 7], _tokens(2, 6)]), sharing="prefix", min_shared_tokens=1)
    decode = [c for c in merged_calls(plan) if c.max_q == 1 and bool(((c.cu_q[1:] - c.cu_q[:-1]) == 0).any())]
    assert decode, "the plan no longer makes the call this test is about"
    qkv, g = _qkv(plan.num_tokens, 4, 2, 16, torch.bfloat16, seed=1)
    _assert_close_to_reference(plan, pair, qkv, g)


def test_the_emulation_reproduces_the_defects(kernel_emulation):
    """The emulation is faithful where the defects live: a column slice of the lse is read as the
    dense block its data pointer starts (wrong gradients, no error), and the decode shortcut's reshape
    fails with an empty query segment."""
    itf = kernel_emulation.flash_attn(VERSIONS[-1])
    (q, k, v), _ = _qkv(6, 4, 2, 16, torch.bfloat16)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    out, lse, *_ = itf._flash_attn_varlen_forward(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3, dropout_p=0.0,
        softmax_scale=0.3, causal=True,
    )  # fmt: skip
    wide = torch.cat([torch.zeros_like(lse), lse], dim=1)  # the lse as columns of a wider one
    grads = {}
    for name, given in (("dense", lse), ("slice", wide[:, 6:])):
        dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        itf._flash_attn_varlen_backward(
            dout=out, q=q, k=k, v=v, out=out, softmax_lse=given, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu,
            cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3, dropout_p=0.0, softmax_scale=0.3, causal=True,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, deterministic=False,
        )  # fmt: skip
        grads[name] = dq
    assert not torch.equal(grads["dense"], grads["slice"])  # strides ignored, as on the GPU
    cu_q = torch.tensor([0, 1, 1], dtype=torch.int32)  # one query, then an empty segment
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        itf._flash_attn_varlen_forward(
            q=q[:1], k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=3, dropout_p=0.0,
            softmax_scale=0.3, causal=False,
        )  # fmt: skip


@pytest.mark.parametrize("version", VERSIONS)
def test_the_emulated_kernel_makes_the_cpp_checks(kernel_emulation, version):
    """What flash_api.cpp refuses, the emulation refuses (through the real interface)."""
    itf = kernel_emulation.flash_attn(version)
    (q, k, v), _ = _qkv(6, 4, 2, 16, torch.bfloat16)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)

    def fwd(q=q, k=k, v=v, cu_q=cu, **kw):
        return itf._flash_attn_varlen_forward(
            q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu, max_seqlen_q=3, max_seqlen_k=3, dropout_p=0.0,
            softmax_scale=0.3, causal=True, **kw,
        )  # fmt: skip

    fwd()
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        fwd(*(x.float() for x in (q, k, v)))
    with pytest.raises(RuntimeError, match="int32"):
        fwd(cu_q=cu.long())
    with pytest.raises(RuntimeError, match="must divide"):
        fwd(q=q[:, :3].contiguous())
    if version >= "2.7":  # 2.6 pads the head dim itself
        with pytest.raises(RuntimeError, match="multiple of 8"):
            fwd(*(x[..., :12].contiguous() for x in (q, k, v)))
    # a strided last dim is made contiguous by the interface (maybe_contiguous), as on the GPU
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(fwd(q=strided)[0], fwd()[0])


@pytest.mark.parametrize("name", PAIRS)
def test_rows_without_keys_merge_to_zero_not_nan(kernel_emulation, name):
    """A call whose query segment has no keys: flash writes lse = +inf and output 0 there; the
    merge gives those rows the first call's output alone, and the backward no NaN."""
    pair = _pair(kernel_emulation, name)
    t, split = 10, 6
    (q, k, v), g = _qkv(t, 4, 2, 16, torch.bfloat16, seed=2)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    calls = [
        VarlenCall(
            0, t, 0, t, cu_seqlens(i32([split, t - split])), cu_seqlens(i32([split, t - split])), split, split, True
        ),
        # rows split..t: two query segments, the second (rows 8, 9) with no keys
        VarlenCall(split, t, 0, split, cu_seqlens(i32([2, 2])), cu_seqlens(i32([split, 0])), 2, split, False),
    ]

    def reference(q, k, v):
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, 1)) * 0.3
        seg = torch.tensor([0] * split + [1] * (t - split))
        pos = torch.arange(t)
        allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
        allowed[split : split + 2, :split] = True  # the cross call's first segment sees the first sequence
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        return torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(2, 1))

    got = _grads(lambda q, k, v: MergedSplitAttention.apply(q, k, v, calls, pair, 0.3), q, k, v, g)
    want = _grads(reference, *(x.double() for x in (q, k, v)), g)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), what
        rel = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert rel < REL_TOL[torch.bfloat16], f"{what}: {rel:.3g}"


def test_merge_of_keyless_partials_is_nan_free():
    out = torch.zeros(3, 1, 2)
    part = torch.ones(3, 1, 2)
    lse = torch.tensor([[float("inf"), float("-inf"), 0.0]])
    part_lse = torch.tensor([[float("-inf"), float("inf"), float("inf")]])
    merged._merge_into(out, lse, part, part_lse)
    assert torch.equal(out[:, 0, 0], torch.zeros(3))
    assert lse.tolist() == [[float("inf"), float("inf"), 0.0]]


@pytest.fixture
def varlen_attn_2_10(kernel_emulation, monkeypatch):
    """torch 2.10's varlen_attn (no scale, no window_size: is_causal instead) over the emulated aten
    ops; zorro reads its signature afresh."""
    import torch.nn.attention.varlen as varlen

    kernel_emulation.aten()
    real = varlen.varlen_attn

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
        return real(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, 0) if is_causal else (-1, -1))

    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)
    backends._varlen_attn_takes.cache_clear()
    monkeypatch.setattr(BACKENDS["torch_varlen"], "unavailable", lambda device: None)
    yield
    backends._varlen_attn_takes.cache_clear()


def _segments(lens):
    t = torch.tensor(lens)
    n = int(t.sum())
    return Segments(0, torch.arange(n), cu_seqlens(t), cu_seqlens(t), max(lens), max(lens), True, n, n)


def test_torch_2_10_varlen_attn_is_routed_to_sdpa(varlen_attn_2_10):
    """Issue #46 item 5: the gather path (windowed plans) called varlen_attn with scale and
    window_size, which torch 2.10's lacks (TypeError); now the call runs sdpa's path, said once."""
    (q, k, v), _ = _qkv(9, 4, 2, 16, torch.bfloat16, seed=3)
    seg = _segments([4, 5])
    with pytest.warns(RuntimeWarning, match="takes no scale or window_size"):
        out = BACKENDS["torch_varlen"].varlen(q, k, v, seg, 0.3, window=3)
    ref = BACKENDS["reference"].varlen(q.double(), k.double(), v.double(), seg, 0.3, window=3)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < REL_TOL[torch.bfloat16]


def test_torch_varlen_gather_path_pads_head_dims_to_8(kernel_emulation, monkeypatch):
    """The non-merged torch path with a head dim of 12: torch's flash op takes multiples of 8 (the
    emulated op refuses 12, as the vendored C++ does); zorro pads with zeros and crops."""
    kernel_emulation.aten(calls := Calls())
    monkeypatch.setattr(BACKENDS["torch_varlen"], "unavailable", lambda device: None)
    (q, k, v), _ = _qkv(9, 4, 2, 12, torch.bfloat16, seed=4)
    seg = _segments([4, 5])
    with pytest.raises(RuntimeError, match="multiple of 8"):
        BACKENDS["torch_varlen"].kernel(q, k, v, seg, 0.3, 3)
    calls.n = 0
    out = BACKENDS["torch_varlen"].varlen(q, k, v, seg, 0.3, window=3)
    ref = BACKENDS["reference"].varlen(q.double(), k.double(), v.double(), seg, 0.3, window=3)
    assert calls.n == 1 and out.shape == ref.shape
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("name", PAIRS)
def test_pairs_refuse_float32_before_the_kernel(kernel_emulation, name):
    pair = _pair(kernel_emulation, name, calls := Calls())
    (q, k, v), _ = _qkv(6, 2, 2, 16, torch.float32)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="float16/bfloat16 only, not torch.float32"):
        pair.forward(q, k, v, cu, cu, 6, 6, True, 0.3)
    assert calls.n == 0


def test_float32_sdpa_on_cuda_keeps_sdpa(monkeypatch):
    """An fp32 model with "sdpa" on CUDA: torch_varlen (half only) is not chosen for it."""
    monkeypatch.setattr(BACKENDS["torch_varlen"], "unavailable", lambda device: None)
    assert default_backend("sdpa", "cuda", torch.float32) == "sdpa"
    assert default_backend("sdpa", "cuda", torch.bfloat16) == "torch_varlen"
    assert default_backend("sdpa", "cuda") == "torch_varlen"


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
def test_rocm_is_refused_with_its_reason(monkeypatch, backend):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    why = backend_unavailable(backend, "cuda")
    assert why is not None and "ROCm" in why and "lse" in why
    assert "ROCm" in (BACKENDS[backend].pair.unavailable(torch.device("cuda")) or "")


@pytest.mark.parametrize("name", PAIRS)
def test_a_kernel_returning_another_lse_layout_is_refused(kernel_emulation, name, monkeypatch):
    """The forward checks the lse it gets back (dtype, shape, density): a kernel whose layout
    differs (here: the same numbers transposed, as a padded or [T, H] layout would be) is an error
    naming the layout, never a wrong gradient."""
    pair = _pair(kernel_emulation, name)
    if name == "torch_varlen":
        real = torch.ops.aten._flash_attention_forward

        class Ops:
            _flash_attention_backward = torch.ops.aten._flash_attention_backward

            @staticmethod
            def _flash_attention_forward(*a, **kw):
                out, lse, *rest = real(*a, **kw)
                return (out, lse.T.contiguous().T, *rest)

        pair = TorchFlashPair(ops=Ops())
    else:
        itf = pair.interface
        version = pair._version

        class Interface:
            _flash_attn_varlen_backward = itf._flash_attn_varlen_backward

            @staticmethod
            def _flash_attn_varlen_forward(**kw):
                res = list(itf._flash_attn_varlen_forward(**kw))
                i = 5 if version.startswith("2.6") else 1
                res[i] = res[i].T.contiguous().T  # the same values, column-major
                return tuple(res)

        pair = FlashAttnPair(interface=Interface(), version=version)
    (q, k, v), _ = _qkv(6, 4, 2, 16, torch.bfloat16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        pair.forward(q, k, v, cu, cu, 6, 6, True, 0.3)


def test_flash_attn_outside_2_6_to_2_8_is_refused():
    (q, k, v), _ = _qkv(6, 2, 2, 16, torch.bfloat16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    for version in ("2.5.9", "3.0.0"):
        with pytest.raises(RuntimeError, match=f"flash-attn {version}"):
            FlashAttnPair(interface=object(), version=version).forward(q, k, v, cu, cu, 6, 6, True, 0.3)


def test_gradients_of_several_calls_are_summed_in_float32(kernel_emulation):
    """Per-call dq/dk/dv are accumulated in float32 and rounded once (as one kernel call's
    accumulators are): the merged gradient is the float32 sum of the calls' gradients, rounded. A
    three-level trie, so a root's keys get gradients from three calls (two would round once anyway)."""
    pair = _pair(kernel_emulation, "torch_varlen")
    p, r = _tokens(6, 8), _tokens(3, 9)
    batch = _batch([p] * 4, [[*r, 1, 2], [*r, 1, 3], [*r, 4], [5, 6]])
    plan = build_dedup_plan(batch, sharing="prefix", min_shared_tokens=1)
    assert len(plan.levels) >= 3
    (q, k, v), g = _qkv(plan.num_tokens, 4, 2, 16, torch.bfloat16, seed=5)
    calls = merged_calls(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _grads(lambda q, k, v: MergedSplitAttention.apply(q, k, v, calls, pair, 0.3), q, k, v, g)
    out = got[0].detach()
    _, lse_all = merged._forward(pair, calls[0], q, k, v, 0.3)
    lse_all = merged._keyless_as_inf(lse_all)
    for c in calls[1:]:
        o, s = merged._forward(pair, c, q, k, v, 0.3)
        merged._merge_into(torch.zeros_like(o), lse_all[:, c.q0 : c.q1], o, s)
    sums = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
    for c in calls:
        parts = merged._backward(pair, c, g, q, k, v, out, lse_all, 0.3)
        for total, part, rows in zip(sums, parts, (slice(c.q0, c.q1), slice(c.k0, c.k1), slice(c.k0, c.k1))):
            total[rows] += part.float()
    for a, b in zip(got[1:], sums):
        assert torch.equal(a, b.to(torch.bfloat16))


@pytest.mark.parametrize("version", VERSIONS)
def test_flash_attn_gather_path_through_each_release(kernel_emulation, monkeypatch, version):
    """A window that cuts a prompt keeps the gather path: flash-attn's public flash_attn_varlen_func
    (each release's own, its window argument and its autograd Function) over the emulated kernel."""
    calls = Calls()
    kernel_emulation.flash_attn(version, calls)
    monkeypatch.setattr(BACKENDS["flash_attn"], "unavailable", lambda device: None)
    (q, k, v), g = _qkv(9, 4, 2, 12, torch.bfloat16, seed=6)  # 12: the public wrapper pads to 16 itself
    seg = _segments([4, 5])
    got = _grads(lambda q, k, v: BACKENDS["flash_attn"].varlen(q, k, v, seg, 0.3, window=3), q, k, v, g)
    want = _grads(
        lambda q, k, v: BACKENDS["reference"].varlen(q, k, v, seg, 0.3, window=3), *(x.double() for x in (q, k, v)), g
    )
    assert calls.n == 1 and calls.windows == [(2, 0)]
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        rel = ((a.double() - b).abs().max() / b.abs().max()).item()
        assert rel < REL_TOL[torch.bfloat16], f"{what}: {rel:.3g}"
