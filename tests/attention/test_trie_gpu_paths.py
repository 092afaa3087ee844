"""sharing="prefix" on the GPU paths: the flex BlockMask equals the trie's mask (checked on CPU by
evaluating the mask_mod densely); on CUDA, flex mask mode and the varlen backends (one gather of
[parent path | own] keys per node) equal the baseline."""

import pytest
import torch
from test_trie import tree_batch

from zorro_core import BaselineActor, DeduplicatedActor, build_dedup_plan, create_dummy_batch
from zorro_core.attention.backends import backend_unavailable
from zorro_core.attention.flex import BLOCK, flex_unavailable
from zorro_core.attention.layouts import layouts_of


@pytest.mark.parametrize("window", [None, 3])
def test_tree_block_mask_matches_plan_mask(monkeypatch, window):
    pytest.importorskip("torch.nn.attention.flex_attention")
    import torch.nn.attention.flex_attention as fa
    from torch.nn.attention.flex_attention import create_mask

    from zorro_core.attention.tree import tree_block_mask

    plan = build_dedup_plan(tree_batch(), sharing="prefix", min_shared_tokens=1)
    captured = {}

    def fake(mask_mod, b, h, q_len, kv_len, device):
        captured["dense"] = create_mask(mask_mod, b, h, q_len, kv_len, device=device)[0, 0]
        return "block-mask"

    monkeypatch.setattr(fa, "create_block_mask", fake)
    assert tree_block_mask(plan, window) == "block-mask"
    dense, t = captured["dense"], plan.num_tokens
    want = plan.attention_mask()
    if window is not None:
        pos = plan.position_ids
        want = want & (pos[:, None] - pos[None, :] < window)
    assert dense.shape == (BLOCK, BLOCK) and torch.equal(dense[:t, :t], want)
    assert not dense[:t, t:].any() and not dense[t:, :t].any() and dense[t:, t:].diagonal().all()


def test_level_k_index_lists_each_nodes_path_then_itself():

    plan = build_dedup_plan(tree_batch(), sharing="prefix", min_shared_tokens=1)
    mask = plan.attention_mask()
    for level in plan.levels[1:]:
        seg = level.seg
        idx = layouts_of(plan).level_k_index(level, torch.device("cpu"))
        assert idx.numel() == seg.total_k
        for i in range(seg.num_segments):
            keys = idx[int(seg.cu_k[i]) : int(seg.cu_k[i + 1])]
            last_query = seg.q_start + int(seg.cu_q[i + 1]) - 1
            assert torch.equal(keys, mask[last_query].nonzero().flatten())  # all it may see, in order


def _cuda_batch():
    return create_dummy_batch(
        batch_size=8,
        num_unique_prompts=4,
        prompt_len=40,
        response_len=9,
        vocab_size=256,
        vary_lengths=True,
        shared_prefix_len=12,
        device="cuda",
    )


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_prefix_flex_matches_baseline_on_cuda(dtype, atol):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    why = flex_unavailable("cuda")
    if why:
        pytest.skip(why)
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3"), dtype=dtype, device="cuda", attn_implementation="sdpa")
    batch = _cuda_batch()
    d = DeduplicatedActor(
        model=model,
        use_split_attention=False,
        attn_implementation="flex_attention",
        sharing="prefix",
        min_shared_tokens=1,
    ).forward(batch)
    b = BaselineActor(model=model, attn_implementation="sdpa").forward(batch).log_probs
    assert d.plan.depth >= 3 and (d.log_probs - b).abs().max().item() < atol


@pytest.mark.parametrize("backend", ["torch_varlen", "flash_attn"])
def test_prefix_varlen_backends_match_baseline_on_cuda(backend):
    why = backend_unavailable(backend, "cuda" if torch.cuda.is_available() else "cpu")
    if why:
        pytest.skip(why)
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    batch = _cuda_batch()
    d = DeduplicatedActor(model=model, varlen_backend=backend, sharing="prefix", min_shared_tokens=1).forward(batch)
    b = BaselineActor(model=model, varlen_backend=backend).forward(batch).log_probs
    assert d.plan.depth >= 3 and (d.log_probs - b).abs().max().item() < 0.1
