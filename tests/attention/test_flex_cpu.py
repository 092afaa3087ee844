"""flex mask mode through the real flex_attention on CPU, against the per-sequence float64 reference.

On CPU zorro runs flex_attention uncompiled with its CPU-backward refusal lifted for zorro's own
calls (zorro_core.attention.flex). The eager kernel evaluates the BlockMask's mask_mod densely,
so these tests check the masks (prompt and tree, windows, padding) and the kernel's gradients,
not block skipping; the compiled forward, which uses the block tables, is the slow test at the end.
"""

import copy
import threading

import pytest
import torch
from helpers import ACTOR_BATCHES, GRAD_RTOL, LP_ATOL, check
from test_families_sliding import BATCHES as SLIDING_BATCHES
from test_trie_actor import BATCHES as TREE_BATCHES

from zorro_core import DeduplicatedActor, create_dummy_batch
from zorro_core.attention.flex import flex_unavailable
from zorro_core.verify.reference import actor_run, max_rel_grad_error

fa = pytest.importorskip("torch.nn.attention.flex_attention")
if flex_unavailable("cpu"):
    pytest.skip(flex_unavailable("cpu"), allow_module_level=True)

TEMPERATURE = 0.7
PROMPT_BATCHES = {name: ACTOR_BATCHES[name] for name in ("mixed", "dummy_padded", "dummy_unpadded")}
PREFIX_BATCHES = {name: TREE_BATCHES[name] for name in ("tree", "system_padded", "system_unpadded")}
BATCHES = {
    **{("prompt", k): v for k, v in PROMPT_BATCHES.items()},
    **{("prefix", k): v for k, v in PREFIX_BATCHES.items()},
}
BATCHES.update({("window", k): v for k, v in SLIDING_BATCHES.items() if k in ("long_padded", "unpadded")})


def flex_actor(model, sharing="prompt"):
    kw = dict(sharing="prefix", min_shared_tokens=1) if sharing == "prefix" else {}
    return DeduplicatedActor(model=model, use_split_attention=False, attn_implementation="flex_attention", **kw)


@pytest.fixture(scope="module")
def references(tiny_models, per_sequence_reference):
    def get(family, kind, batch_name):
        return per_sequence_reference(
            (family, kind, batch_name), lambda: tiny_models(family), BATCHES[kind, batch_name], TEMPERATURE, seed=5
        )

    return get


# The default run: prompt and tree masks, a window (tiny-qwen2-sliding: full and windowed layers),
# padded and unpadded, ~0.5-1 s each (the eager kernel evaluates mask_mod through vmap).
FAST = [
    ("tiny-qwen3", "prompt", "prompt", "mixed"),
    ("tiny-qwen3", "prompt", "prompt", "dummy_unpadded"),
    ("tiny-qwen3", "prefix", "prefix", "tree"),
    ("tiny-qwen3", "prefix", "prefix", "system_padded"),
    ("tiny-qwen2-sliding", "prompt", "window", "long_padded"),
    ("tiny-qwen2-sliding", "prefix", "window", "unpadded"),
]
# The rest of the grid (another family, every window layer, the remaining batches): `pytest -m slow`.
REST = [
    ("tiny-qwen3", "prompt", "prompt", "dummy_padded"),
    ("tiny-qwen3", "prefix", "prefix", "system_unpadded"),
    ("tiny-llama", "prompt", "prompt", "mixed"),
    ("tiny-llama", "prefix", "prefix", "tree"),
    ("tiny-qwen2-sliding", "prompt", "window", "unpadded"),
    ("tiny-qwen2-sliding", "prefix", "window", "long_padded"),
] + [("tiny-mistral", s, "window", b) for s in ("prompt", "prefix") for b in ("long_padded", "unpadded")]


@pytest.mark.parametrize(
    "family,sharing,kind,batch_name", FAST + [pytest.param(*case, marks=pytest.mark.slow) for case in REST]
)
def test_flex_mask_mode_on_cpu_matches_per_sequence(tiny_models, references, family, sharing, kind, batch_name):
    batch, w, ref = references(family, kind, batch_name)
    out = check(flex_actor(tiny_models(family), sharing), batch, w, ref, TEMPERATURE)
    assert out.plan.num_tokens < out.plan.logical_tokens  # something was shared
    if sharing == "prefix" and batch_name == "tree":
        assert out.plan.depth == 4


def test_a_wrong_mask_fails_through_flex(tiny_models, references, monkeypatch):
    """Responses of a group that see each other (one segment for all of them) fail by far more than
    the tolerance: the comparison above can fail through the flex kernel."""
    import zorro_core.attention.hook as hook

    real = hook.plan_block_mask

    def merged_responses(plan, window):
        bad = copy.copy(plan)
        bad.token_segment = plan.token_segment.clamp(max=plan.num_groups)
        return real(bad, window)

    monkeypatch.setattr(hook, "plan_block_mask", merged_responses)
    batch, w, ref = references("tiny-qwen3", "prompt", "mixed")
    lp, _, grads, _ = actor_run(flex_actor(tiny_models("tiny-qwen3")), batch, TEMPERATURE, w)
    g_err, _ = max_rel_grad_error(grads, ref[2])
    assert (lp - ref[0]).abs().max().item() > 1e3 * LP_ATOL or g_err > 1e3 * GRAD_RTOL


def _grad_inputs():
    q, k, v = (torch.randn(1, 2, 128, 8, requires_grad=True) for _ in range(3))
    return q, k, v


def test_the_lift_is_scoped_to_zorros_calls(tiny_models):
    """Outside zorro's call, and in another thread during it, flex_attention still refuses CPU grads."""
    from zorro_core.attention import flex

    check_before = fa._validate_device
    flex_actor(tiny_models("tiny-qwen3")).forward(ACTOR_BATCHES["mixed"]())
    assert fa._validate_device is check_before
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        fa.flex_attention(*_grad_inputs())

    seen = {}

    def other_thread():
        try:
            fa.flex_attention(*_grad_inputs())
        except NotImplementedError as e:
            seen["refused"] = str(e)

    with flex._cpu_grad_allowed():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        fa._validate_device(*_grad_inputs())  # this thread: lifted
    assert "backward on CPU" in seen["refused"]
    assert fa._validate_device is check_before


# ------------------------------------------------------------ compiled forward (block tables)


@pytest.mark.slow  # Inductor compiles each (mask, window) in ~15-60 s: 2-4 minutes in all on 2 loaded cores
@pytest.mark.parametrize("family,sharing", [("tiny-qwen3", "prompt"), ("tiny-qwen2-sliding", "prefix")])
def test_compiled_flex_forward_on_cpu_uses_the_block_tables(tiny_models, monkeypatch, family, sharing):
    """flex_attention compiled (Inductor C++, dynamic=False; dynamic=True fails to compile a tree mask on
    CPU in torch 2.13) over a packed row of several 128-blocks, some skipped: the log-probs equal the
    reference (float32: Inductor's CPU flex takes no float64), and the kernel reads the block tables
    (dropping a block from them changes its output, which the eager kernel ignores)."""
    from zorro_core.attention import flex
    from zorro_core.verify.reference import sequence_forward

    model64 = tiny_models(family)
    model = copy.deepcopy(model64).float()
    batch = create_dummy_batch(
        batch_size=8,
        num_unique_prompts=4,
        prompt_len=160,  # prompts over a block each: a group's blocks skip the other groups'
        response_len=20,
        vocab_size=256,
        vary_lengths=False,  # equal lengths, so that blocks line up with groups and some are skipped
        shared_prefix_len=8,
        seed=3,
    )
    compiled = torch.compile(fa.flex_attention, dynamic=False)
    calls = []

    def kernel(device):
        def run(q, k, v, **kw):
            calls.append((q, k, v, kw))
            return compiled(q, k, v, **kw)

        return run

    monkeypatch.setattr(flex, "_kernel", kernel)
    with torch.no_grad():
        ref_lp, _ = sequence_forward(model64, batch, TEMPERATURE)
        out = flex_actor(model, sharing).forward(batch, temperature=TEMPERATURE)
        err = (out.log_probs.double() - ref_lp).abs().max().item()
        assert err < 1e-4, f"compiled flex log-prob error {err:.2e}"
        q, k, v, kw = calls[0]
        mask = kw["block_mask"]
        # some query block skips a kv block below the diagonal (not only the causal upper triangle)
        seen = mask.kv_num_blocks[0, 0] + (0 if mask.full_kv_num_blocks is None else mask.full_kv_num_blocks[0, 0])
        assert (seen < torch.arange(1, seen.numel() + 1)).any(), seen
        # Drop each query block's last partial kv block from the tables: same shapes, so no recompile.
        dropped = fa.BlockMask.from_kv_blocks(
            (mask.kv_num_blocks - 1).clamp(min=0),
            mask.kv_indices,
            mask.full_kv_num_blocks,
            mask.full_kv_indices,
            BLOCK_SIZE=mask.BLOCK_SIZE,
            mask_mod=mask.mask_mod,
        )
        assert not torch.allclose(compiled(q, k, v, **{**kw, "block_mask": dropped}), compiled(q, k, v, **kw))
        with flex._cpu_grad_allowed():
            eager = fa.flex_attention(q, k, v, **{**kw, "block_mask": dropped})
        assert torch.allclose(eager, compiled(q, k, v, **kw), atol=1e-5)
