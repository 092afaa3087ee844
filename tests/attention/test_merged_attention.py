"""The gather-free split path (zorro_core.attention.merged) through `flash_cpu`, against the reference
backend in float64: random plans (group sizes, ragged prompts and responses, prefix trees of any
depth), GQA ratios, MLA head dims and windows; planted bugs that must fail; and what it saves for
backward: exactly q, k, v, the output and the lse, never a gathered copy of a prompt's keys."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_core import RolloutBatch, build_dedup_plan
from zorro_core.attention import merged
from zorro_core.attention.backends import BACKENDS
from zorro_core.attention.hook import split_attention
from zorro_core.attention.kernels import CpuFlashPair
from zorro_core.attention.merged import MergedSplitAttention, merge_refusal, merged_calls

TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def _batch(groups, seed=0) -> RolloutBatch:
    """groups: [(prompt_len, [response_len, ...]), ...]; prompts differ in their first token, and with
    `shared` tokens in common after it a prefix tree gets depth > 2."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    common = torch.randint(5, 50, (64,), generator=g).tolist()
    for i, (plen, rlens) in enumerate(groups):
        prompt = [1 + i] + common[: plen - 1]
        for r in rlens:
            prompts.append(prompt)
            # responses of a group often open alike (deeper tries): a shared head, then their own tokens
            head = common[:2] if r > 3 else []
            responses.append((head + torch.randint(5, 50, (r,), generator=g).tolist())[:r])
    return RolloutBatch.from_lists(prompts, responses)


def _run(plan, backend, q, k, v, scale, window, g):
    out = split_attention(plan, q, k, v, scale, window, backend)
    return (out, *torch.autograd.grad((out * g).sum(), (q, k, v)))


def _qkv(t, hq, hkv, d, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda h, dd: torch.randn(t, h, dd, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)  # noqa: E731
    return mk(hq, d), mk(hkv, d), mk(hkv, dv), torch.randn(t, hq, dv, generator=gen, dtype=torch.float64).to(dtype)


def _assert_equal_to_reference(plan, q, k, v, g, window, tol, backend="flash_cpu"):
    got = _run(plan, backend, q, k, v, 0.3, window, g)
    want = _run(plan, "reference", q, k, v, 0.3, window, g)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a.double() - b.double()).abs().max().item()
        assert err < tol, f"{what} differs by {err:.2e}"


groups_st = st.lists(
    st.tuples(st.integers(1, 12), st.lists(st.integers(1, 9), min_size=1, max_size=4)), min_size=1, max_size=4
)


@settings(max_examples=40, deadline=None)
@given(
    groups=groups_st,
    sharing=st.sampled_from(["prompt", "prefix"]),
    heads=st.sampled_from([(2, 2), (4, 2), (6, 2), (4, 1)]),
    dims=st.sampled_from([(8, 8), (12, 8), (8, 12)]),
    window=st.sampled_from([None, 2, 5, 64]),
    seed=st.integers(0, 3),
)
def test_property_flash_cpu_equals_reference_float64(groups, sharing, heads, dims, window, seed):
    batch = _batch(groups, seed)
    plan = build_dedup_plan(batch, sharing=sharing, **({"min_shared_tokens": 1} if sharing == "prefix" else {}))
    q, k, v, g = _qkv(plan.num_tokens, *heads, *dims, torch.float64, seed)
    _assert_equal_to_reference(plan, q, k, v, g, window, TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_flash_cpu_ragged_groups_and_deep_tree(dtype, sharing):
    groups = [(9, [3, 7, 1]), (4, [5]), (12, [2, 8, 6, 4]), (1, [1, 1])]
    plan = build_dedup_plan(
        _batch(groups), sharing=sharing, **({"min_shared_tokens": 1} if sharing == "prefix" else {})
    )
    if sharing == "prefix":
        assert plan.depth >= 3
    q, k, v, g = _qkv(plan.num_tokens, 4, 2, 8, 8, dtype, 0)
    _assert_equal_to_reference(plan, q, k, v, g, None, TOL[dtype])
    assert merge_refusal(plan, None) is None


def test_window_that_cuts_a_prompt_keeps_the_gather_path_and_says_so():
    plan = build_dedup_plan(_batch([(9, [3, 7]), (6, [5, 2])]))
    assert merge_refusal(plan, 64) is None  # wider than every path: the window never binds
    assert "cuts a prompt" in merge_refusal(plan, 4)
    q, k, v, g = _qkv(plan.num_tokens, 4, 2, 8, 8, torch.float64, 1)
    with pytest.warns(RuntimeWarning, match="gather path"):
        _assert_equal_to_reference(plan, q, k, v, g, 4, TOL[torch.float64])


# ---------------------------------------------------------------- planted bugs


def _plan_and_inputs():
    plan = build_dedup_plan(_batch([(9, [3, 7, 4]), (6, [5, 2]), (5, [4])]))
    return plan, *_qkv(plan.num_tokens, 4, 2, 8, 8, torch.float64, 2)


def _errors(plan, q, k, v, g):
    got = _run(plan, "flash_cpu", q, k, v, 0.3, None, g)
    want = _run(plan, "reference", q, k, v, 0.3, None, g)
    return [(a - b).abs().max().item() for a, b in zip(got, want)]


def test_planted_partial_lse_in_backward_fails(monkeypatch):
    """Backward handed each partial's own lse (not the merged one): the output is right, the gradients wrong."""
    plan, q, k, v, g = _plan_and_inputs()
    pair = CpuFlashPair()
    seen = {}

    class Planted(CpuFlashPair):
        def forward(self, q, k, v, cu_q, *rest):
            out, lse = pair.forward(q, k, v, cu_q, *rest)
            seen[id(cu_q)] = lse
            return out, lse

        def backward(self, dout, q, k, v, out, lse, cu_q, *rest):
            return pair.backward(dout, q, k, v, out, seen.get(id(cu_q), lse), cu_q, *rest)

    monkeypatch.setattr(BACKENDS["flash_cpu"], "pair", Planted())
    errs = _errors(plan, q, k, v, g)
    assert errs[0] < 1e-12 and max(errs[1:]) > 1e-3


def test_planted_queries_against_the_next_groups_prompt_fails(monkeypatch):
    """A group's responses against the next group's prompt keys: caught in the output."""
    plan, q, k, v, g = _plan_and_inputs()
    real = merged._prompt_calls

    def shifted(p):
        calls = real(p)
        c = calls[1]
        lens = (c.cu_q[1:] - c.cu_q[:-1]).roll(1)
        return [
            calls[0],
            merged.VarlenCall(c.q0, c.q1, c.k0, c.k1, merged.cu_seqlens(lens), c.cu_k, c.max_q, c.max_k, False),
        ]

    monkeypatch.setattr(merged, "_prompt_calls", shifted)
    assert _errors(plan, q, k, v, g)[0] > 1e-2


# ---------------------------------------------------------------- what is saved for backward


def _saved_storages(fn):
    """{storage data_ptr: nbytes} of every tensor autograd saves while fn() runs, and fn's result."""
    saved = {}

    def pack(t):
        s = t.untyped_storage()
        saved[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_saves_q_k_v_out_lse_and_nothing_gathered(sharing):
    """The merged call saves exactly q, k, v, its output and the lse: the bytes of one flash call over
    the packed row. The gather path saves more (each response's copy of its prompt's keys/values)."""
    plan = build_dedup_plan(
        _batch([(12, [3, 7, 4, 5]), (8, [5, 2])]),
        sharing=sharing,
        **({"min_shared_tokens": 1} if sharing == "prefix" else {}),
    )
    t = plan.num_tokens
    q, k, v = (torch.randn(t, h, 8, dtype=torch.float32) for h in (4, 2, 2))
    leaf = [x.requires_grad_(True) for x in (q, k, v)]
    saved, out = _saved_storages(lambda: MergedSplitAttention.apply(*leaf, merged_calls(plan), CpuFlashPair(), 0.3))
    lse_bytes = 4 * t * 4  # [Hq, T] float32
    expected = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in (q, k, v, out)}
    assert {p: n for p, n in saved.items() if p in expected} == expected
    assert sum(saved.values()) == sum(expected.values()) + lse_bytes
    k_bytes = k.untyped_storage().nbytes()
    assert max(n for p, n in saved.items() if p not in expected) == lse_bytes  # the lse, no K/V copy
    # the gather path, for contrast: its saved bytes exceed the packed row's by the gathered prompts
    gathered, _ = _saved_storages(lambda: split_attention(plan, *leaf, 0.3, None, "flash_cpu_gather"))
    assert sum(gathered.values()) > sum(saved.values()) + k_bytes


def test_one_output_buffer_for_causal_and_cross():
    """The causal and cross results land in one tensor (no torch.cat of two): the output's storage
    is exactly [T, Hq, Dv]."""
    plan = build_dedup_plan(_batch([(6, [3, 4]), (5, [2])]))
    q, k, v = (torch.randn(plan.num_tokens, h, 8) for h in (2, 2, 2))
    out = split_attention(plan, q, k, v, 0.3, None, "flash_cpu")
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()
    assert out.is_contiguous()


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
def test_cuda_pairs_gather_free_match_reference(backend, sharing):
    """On a GPU, the real kernel pairs on the gather-free path against the exact reference backend
    (bf16 inputs; the reference in float64 on the same rounded inputs). CPU: the stand-in tests."""
    from zorro_core.attention.backends import backend_unavailable

    why = backend_unavailable(backend, "cuda") if torch.cuda.is_available() else "needs a CUDA device"
    if why:
        pytest.skip(f"{backend}: {why} (the glue is covered on CPU by tests/attention/test_gpu_glue.py's stand-ins)")
    batch = _batch([(40, [17, 33, 8]), (25, [12]), (64, [9, 30])]).to("cuda")
    plan = build_dedup_plan(batch, sharing=sharing, **({"min_shared_tokens": 1} if sharing == "prefix" else {}))
    q, k, v, g = (x.detach().to("cuda") for x in _qkv(plan.num_tokens, 8, 2, 64, 64, torch.bfloat16, 3))
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    got = _run(plan, backend, q, k, v, 0.125, None, g)
    q64, k64, v64 = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    want = _run(plan, "reference", q64, k64, v64, 0.125, None, g.double())
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        assert err < 2e-2, f"{what} differs by {err:.2e} (relative to its largest entry)"


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
@pytest.mark.parametrize("checkpointing", [None, "non-reentrant"])
def test_verify_gradients_through_flash_cpu(sharing, checkpointing):
    """`zorro verify gradients --varlen-backend flash_cpu` on every tiny full-attention family, float64
    and float32, both layouts: the dedup actor and the baseline on the gather-free path against the
    float64 per-sequence reference (log-probs, entropy, every gradient)."""
    from zorro_core.actor.config import ActorConfig
    from zorro_core.verify.gradients import expand_cases, verify_cases

    models = ["tiny-qwen3", "tiny-llama", "tiny-mistral", "tiny-qwen3-moe", "tiny-deepseek-v3", "tiny-gemma3"]
    cases = expand_cases(
        models,
        ["sdpa"],
        ["float64", "float32"],
        ["padded", "unpadded"],
        ["split"],
        ["compute"],
        ActorConfig(sharing=sharing, min_shared_tokens=1),
        ["flash_cpu"],
    )
    results = verify_cases(cases, checkpointing=checkpointing)
    bad = [(r.case.name, r.status, r.reason) for r in results if r.status != "pass"]
    assert not bad and len(results) == len(models) * 4
