"""The GPU glue on CPU: zorro's flash_attn and torch_varlen backends and the Qwen3-Next fla path, end to
end through the actors, against the float64 per-sequence reference: flash-attn's own interface and
torch's own varlen_attn over the kernels' CPU emulation (tests/kernel_emulation), which refuses what
the compiled kernels refuse; fla through a contract stand-in (tests/varlen_standins.py).

16-bit cases follow `zorro verify`'s rule: dedup's error against ref64 is at most FACTOR x the
baseline's (same backend, no dedup) + the float64 floor, for log-probs, entropy and every gradient.
"""

import copy

import pytest
import torch
from test_actor import BATCHES
from varlen_standins import (
    Calls,
    ContractError,
    chunk_gated_delta_rule,
    install_fla,
    install_flash_attn,
    install_torch_varlen,
)

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.models.presets import build_model, preset_config
from zorro_core.verify.gradients import Errors, judge
from zorro_core.verify.reference import actor_run, max_abs_error, per_sequence, rel_grad_errors, token_weights

INSTALL = {
    "flash_attn": install_flash_attn,
    "torch_varlen": install_torch_varlen,
    # torch 2.11's varlen_attn (no enable_gqa: zorro expands the K/V heads itself)
    "torch_varlen_2.11": lambda emu, mp, calls: install_torch_varlen(emu, mp, calls, enable_gqa_kwarg=False),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _errors(actor, batch, w, ref) -> Errors:
    lp, ent, grads, _ = actor_run(actor, batch, 1.0, w)
    return Errors(max_abs_error(lp, ref[0]), max_abs_error(ent, ref[1]), rel_grad_errors(grads, ref[2]))


@pytest.fixture(scope="module")
def setups():
    cache = {}

    def get(family, layout):
        if (family, layout) not in cache:
            m64 = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager", seed=0)
            batch = BATCHES[layout]()
            w = token_weights(batch, seed=1)
            cache[family, layout] = (m64, batch, w, per_sequence(m64, batch, 1.0, w))
        return cache[family, layout]

    return get


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(
    "family,layout",
    [
        ("tiny-qwen3", "mixed"),
        ("tiny-qwen3", "dummy_unpadded"),
        ("tiny-mistral", "dummy_padded"),
        ("tiny-qwen3-moe", "mixed"),
    ],
)
@pytest.mark.parametrize("backend", list(INSTALL))
def test_half_precision_backend_end_to_end(setups, kernel_emulation, monkeypatch, backend, family, layout, dtype):
    m64, batch, w, ref = setups(family, layout)
    calls = Calls()
    INSTALL[backend](kernel_emulation, monkeypatch, calls)
    model = copy.deepcopy(m64).to(DTYPES[dtype])
    kw = dict(model=model, attn_implementation="sdpa", varlen_backend=backend.split("_2.")[0])
    base = _errors(BaselineActor(**kw), batch, w, ref)
    n_base = calls.n
    dedup = _errors(DeduplicatedActor(**kw), batch, w, ref)
    layers = model.config.num_hidden_layers
    assert n_base == layers and calls.n - n_base in (
        layers,
        2 * layers,
    )  # the emulated kernel ran every layer (self + cross call)
    if family == "tiny-mistral":
        assert (model.config.sliding_window - 1, 0) in calls.windows
    ratio, check, failing = judge(dtype, dedup, base)
    assert not failing, f"{check}: {failing[:3]}"
    assert dedup.log_prob < 0.2  # a half-precision forward, not noise: a wrong plan is off by >1


def test_a_broken_glue_is_caught(setups, kernel_emulation, monkeypatch):
    """The same comparison fails when the glue breaks the kernel's contract or its semantics."""
    m64, batch, w, ref = setups("tiny-qwen3", "mixed")
    calls = Calls()
    install_flash_attn(kernel_emulation, monkeypatch, calls)
    from zorro_core.attention import backends

    be = backends.BACKENDS["flash_attn"]
    pair = be.pair
    model = copy.deepcopy(m64).to(torch.bfloat16)
    base = _errors(BaselineActor(model=model, varlen_backend="flash_attn"), batch, w, ref)
    # int64 offsets: the real kernel refuses them, and so does the emulated one
    broken = copy.copy(pair)
    broken.forward = lambda q, k, v, cu_q, cu_k, *rest: pair.forward(q, k, v, cu_q.long(), cu_k, *rest)
    monkeypatch.setattr(be, "pair", broken)
    with pytest.raises(RuntimeError, match="int32"):
        DeduplicatedActor(model=model, varlen_backend="flash_attn").forward(batch)
    # backward handed each partial's own lse instead of the merged one: caught by the reference comparison
    partial_lse = {}

    def forward(q, k, v, cu_q, cu_k, *rest):
        out, lse = pair.forward(q, k, v, cu_q, cu_k, *rest)
        partial_lse[id(cu_q)] = lse
        return out, lse

    def backward(dout, q, k, v, out, lse, cu_q, *rest):
        return pair.backward(dout, q, k, v, out, partial_lse.get(id(cu_q), lse), cu_q, *rest)

    broken = copy.copy(pair)
    broken.forward, broken.backward = forward, backward
    monkeypatch.setattr(be, "pair", broken)
    dedup = _errors(DeduplicatedActor(model=model, varlen_backend="flash_attn"), batch, w, ref)
    assert judge("bfloat16", dedup, base)[2]


def _qkv(dtype=torch.bfloat16, hq=4, hkv=2, d=16, t=10):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv)]


def _public(kernel_emulation, name):
    """flash-attn's flash_attn_varlen_func or torch's varlen_attn, real, over the emulated kernel."""
    if name == "flash_attn":
        kernel_emulation.flash_attn()
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func
    kernel_emulation.aten()
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@pytest.mark.parametrize("name", ["flash_attn", "varlen_attn"])
def test_the_emulated_kernels_refuse_what_the_kernels_refuse(kernel_emulation, name):
    """Through the libraries' own public functions: what the compiled kernel (or the library's
    Python) refuses, the emulation refuses."""
    fn = _public(kernel_emulation, name)
    q, k, v = _qkv()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    extra = {"enable_gqa": True} if name == "varlen_attn" else {"causal": True}
    fn(q, k, v, cu, cu, 6, 6, window_size=(-1, 0), **extra)  # the valid call runs
    bad = {
        "int64 offsets": lambda: fn(q, k, v, cu.long(), cu, 6, 6, **extra),
        "max length too small": lambda: fn(q, k, v, cu, cu, 5, 6, **extra),
        "float32": lambda: fn(*(x.float() for x in (q, k, v)), cu, cu, 6, 6, **extra),
        "offsets past the end": lambda: fn(q, k, v, torch.tensor([0, 4, 11], dtype=torch.int32), cu, 6, 6, **extra),
        "3 query heads for 2 kv heads": lambda: fn(q[:, :3], k, v, cu, cu, 6, 6, **extra),
    }
    if name == "varlen_attn":
        bad["GQA without enable_gqa"] = lambda: fn(q, k, v, cu, cu, 6, 6)
    for what, call in bad.items():
        with pytest.raises((RuntimeError, ValueError)):
            call()
            pytest.fail(f"accepted: {what}")


def test_kernel_semantics_bottom_right_and_window(kernel_emulation):
    """One segment with 2 queries over 5 keys: query 0 sees keys 0..3, query 1 keys 0..4 (bottom-right);
    window (1, 0): query 0 sees keys 2..3, query 1 keys 3..4."""
    flash_attn_varlen_func = _public(kernel_emulation, "flash_attn")
    varlen_attn = _public(kernel_emulation, "varlen_attn")
    q = torch.zeros(2, 1, 8, dtype=torch.bfloat16)
    k = torch.zeros(5, 1, 8, dtype=torch.bfloat16)
    v = torch.arange(5, dtype=torch.bfloat16)[:, None, None].expand(5, 1, 8).contiguous()
    cq, ck = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cq, ck, 2, 5, causal=True)
    assert out[:, 0, 0].tolist() == [1.5, 2.0]  # uniform weights: mean of the visible keys' values
    out = varlen_attn(q, k, v, cq, ck, 2, 5, window_size=(1, 0))
    assert out[:, 0, 0].tolist() == [2.5, 3.5]
    out = varlen_attn(q, k, v, cq, ck, 2, 5, window_size=(-1, 0))
    assert out[:, 0, 0].tolist() == [1.5, 2.0]


# ---------------------------------------------------------------- Qwen3-Next through fla's varlen call

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def next_batch():
    from test_families_linear import chunk_batch

    return chunk_batch()  # prompts of 40-128 tokens: branches from zero and from carried states, tails replayed


@pytest.fixture(scope="module")
def next_reference():
    from zorro_core.verify.delta_rule import chunk_gated_delta_rule_exact

    saved = qwen3_next.torch_chunk_gated_delta_rule
    qwen3_next.torch_chunk_gated_delta_rule = (
        chunk_gated_delta_rule_exact  # the float64 kernel, as in test_families_linear
    )
    try:
        m64 = build_model(preset_config("tiny-qwen3-next"), dtype=torch.float64, attn_implementation="eager", seed=0)
        batch = next_batch()
        w = token_weights(batch, seed=2)
        return m64, batch, w, per_sequence(m64, batch, 1.0, w)
    finally:
        qwen3_next.torch_chunk_gated_delta_rule = saved


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_qwen3_next_fla_path_end_to_end(next_reference, monkeypatch, dtype):
    m64, batch, w, ref = next_reference
    calls = Calls()
    install_fla(monkeypatch, calls)
    model = copy.deepcopy(m64).to(torch.float64 if dtype == "float64" else torch.bfloat16)
    base = _errors(BaselineActor(model=model, attn_implementation="eager"), batch, w, ref)
    n_base = calls.n
    dedup = _errors(DeduplicatedActor(model=model, attn_implementation="eager"), batch, w, ref)
    linear = sum(t == "linear_attention" for t in model.config.layer_types)
    assert n_base == linear and calls.n - n_base == 2 * linear  # dedup: a head call and a branch call per layer
    ratio, check, failing = judge(dtype, dedup, base)
    assert not failing, f"{check}: {failing[:3]}"


def test_fla_stand_in_refuses_what_fla_refuses():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 12, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 12, 4, 8, generator=g)
    gg, beta = -torch.rand(1, 12, 4, generator=g), torch.rand(1, 12, 4, generator=g)
    cu = torch.tensor([0, 5, 12])
    s0 = torch.zeros(2, 4, 8, 8)
    o, s = chunk_gated_delta_rule(
        q, k, v, gg, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True
    )
    assert o.shape == (1, 12, 4, 8) and s.shape == (2, 4, 8, 8) and s.dtype == torch.float32
    with pytest.raises(ContractError, match="one per sequence"):
        chunk_gated_delta_rule(q, k, v, gg, beta, initial_state=s0[:1], cu_seqlens=cu)
    with pytest.raises(ContractError, match="batch size must be 1"):
        chunk_gated_delta_rule(*(x.expand(2, *x.shape[1:]) for x in (q, k, v, gg, beta)), cu_seqlens=cu)
    with pytest.raises(ContractError, match="int64"):
        chunk_gated_delta_rule(q, k, v, gg, beta, cu_seqlens=cu.int())
    with pytest.raises(ContractError, match="from 0 to 12"):
        chunk_gated_delta_rule(q, k, v, gg, beta, cu_seqlens=torch.tensor([0, 5, 11]))
    # per sequence = each segment alone from its own initial state
    o2, _ = chunk_gated_delta_rule(
        q[:, 5:], k[:, 5:], v[:, 5:], gg[:, 5:], beta[:, 5:], initial_state=s0[1:], use_qk_l2norm_in_kernel=True
    )
    assert torch.allclose(o[:, 5:], o2, atol=1e-6)
