"""sharing="prefix" against the per-sequence float64 reference: log-probs, entropy, every gradient."""

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, MODES, check, mixed_batch
from test_trie import tree_batch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

BATCHES = {
    "tree": tree_batch,  # depth 4 at min_shared_tokens=1: a prefix row, identical rows, runs ending in responses
    "mixed": mixed_batch,  # prompts that share only their beginning
    "system_padded": lambda: create_dummy_batch(
        batch_size=6,
        num_unique_prompts=3,
        prompt_len=12,
        response_len=6,
        vocab_size=256,
        vary_lengths=True,
        shared_prefix_len=4,
        seed=3,
    ),
    "system_unpadded": lambda: create_dummy_batch(
        batch_size=4, num_unique_prompts=2, prompt_len=9, response_len=5, vocab_size=256, shared_prefix_len=5, seed=4
    ),
}
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def references(tiny_models):
    cache = {}

    def get(family, batch_name, **model_kw):
        key = (family, batch_name, tuple(sorted(model_kw.items())))
        if key not in cache:
            batch = BATCHES[batch_name]()
            w = token_weights(batch, seed=1)
            cache[key] = (batch, w, per_sequence(tiny_models(family, **model_kw), batch, TEMPERATURE, w))
        return cache[key]

    return get


def prefix_actor(model, split=True, attn="sdpa", min_shared=1, **kw):
    return DeduplicatedActor(
        model=model,
        use_split_attention=split,
        attn_implementation=attn,
        sharing="prefix",
        min_shared_tokens=min_shared,
        **kw,
    )


@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-qwen2-sliding"])
@pytest.mark.parametrize("split,attn", MODES)
def test_tree_matches_per_sequence(tiny_models, references, family, split, attn):
    batch, w, ref = references(family, "tree")
    out = check(prefix_actor(tiny_models(family), split, attn), batch, w, ref, TEMPERATURE)
    assert out.plan.depth == 4


@pytest.mark.parametrize("batch_name", ["mixed", "system_padded", "system_unpadded"])
@pytest.mark.parametrize("split,attn", [(True, "sdpa"), (True, "eager"), (False, "sdpa")])
@pytest.mark.parametrize("min_shared", [1, 3])
def test_batches_match_per_sequence(tiny_models, references, batch_name, split, attn, min_shared):
    batch, w, ref = references("tiny-qwen3", batch_name)
    out = check(prefix_actor(tiny_models("tiny-qwen3"), split, attn, min_shared), batch, w, ref, TEMPERATURE)
    assert out.plan.num_tokens < out.plan.logical_tokens


@pytest.mark.parametrize("logits_mode", ["none", "compute", "memory"])
@pytest.mark.parametrize("split", [True, False])
def test_logits_modes(tiny_models, references, logits_mode, split):
    batch, w, ref = references("tiny-qwen3", "tree")
    check(
        prefix_actor(tiny_models("tiny-qwen3"), split, logits_mode=logits_mode, logits_chunk_size=3),
        batch,
        w,
        ref,
        TEMPERATURE,
    )


@pytest.mark.parametrize("split,attn", MODES)
def test_moe_matches_and_aux_loss_equals_baseline(tiny_models, references, split, attn):
    batch, w, ref = references("tiny-qwen3-moe", "tree", output_router_logits=True)
    model = tiny_models("tiny-qwen3-moe", output_router_logits=True)
    out = check(prefix_actor(model, split, attn), batch, w, ref, TEMPERATURE)
    base = BaselineActor(model=model, attn_implementation="eager", padded=True).forward(batch).aux_loss
    assert abs(out.aux_loss.item() - base.item()) < 1e-7 * base.item()


def test_default_min_shared_is_exact(tiny_models, references):
    batch, w, ref = references("tiny-qwen3", "system_padded")
    out = check(DeduplicatedActor(model=tiny_models("tiny-qwen3"), sharing="prefix"), batch, w, ref, TEMPERATURE)
    assert out.plan.sharing == "prefix"


def corrupt(plan, what):
    """A deliberately wrong trie plan, for the tests that prove the comparison can fail."""
    if what == "positions_restart":  # every non-root node restarts its positions at 0
        plan.position_ids = plan.position_ids - plan.node_depth[plan.token_node]
    elif what == "sibling_split":  # split mode: a node's keys are another parent's path
        level = next(lv for lv in plan.levels[1:] if lv.prefix_rows.shape[0] > 1)
        level.local = level.local.roll(1)
        level.prefix_len = level.prefix_rows.shape[1] * torch.ones_like(level.prefix_len)
        level.prefix_rows = level.prefix_rows.roll(1, 0)
    elif what == "sibling_mask":  # mask mode: each node also sees the subtree before it
        plan.node_tin = torch.zeros_like(plan.node_tin)
    return plan


@pytest.mark.parametrize("what,split", [("positions_restart", True), ("sibling_split", True), ("sibling_mask", False)])
def test_planted_bugs_fail_by_orders_of_magnitude(tiny_models, references, monkeypatch, what, split):
    import zorro_core.actor.actor as actor_mod

    batch, w, ref = references("tiny-qwen3", "tree")
    real_build = actor_mod.build_dedup_plan
    monkeypatch.setattr(actor_mod, "build_dedup_plan", lambda b, **kw: corrupt(real_build(b, **kw), what))
    lp, ent, grads, _ = actor_run(prefix_actor(tiny_models("tiny-qwen3"), split), batch, TEMPERATURE, w)
    lp_err = (lp - ref[0]).abs().max().item()
    g_err, _ = max_rel_grad_error(grads, ref[2])
    assert lp_err > 1e3 * LP_ATOL or g_err > 1e3 * GRAD_RTOL, (lp_err, g_err)
