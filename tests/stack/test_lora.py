"""LoRA (peft) models through the actors against the per-sequence float64 reference.

The reference runs the PeftModel's own forward one sequence at a time; the actors unwrap it
and run the packed row through the hook. Every trainable parameter (the adapter weights,
and only they) must get the reference's gradient.
"""

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, mixed_batch

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.parts import model_parts, unwrap_adapters
from zorro_core.models.presets import build_model, preset_config
from zorro_core.stack.lora import LoraSettings, apply_lora, lora_unavailable, trainable_parameters
from zorro_core.verify.reference import actor_run, max_rel_grad_error, per_sequence, token_weights

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'zorro[lora]')")

FAMILIES = ["tiny-qwen3", "tiny-llama"]
MODES = [(True, "eager"), (True, "sdpa"), (False, "eager"), (False, "sdpa")]  # (use_split_attention, attn)
# init_lora_weights=False: B starts random, so A's gradient is not zero and the adapter changes the output.
SETTINGS = LoraSettings(r=4, alpha=8, init_lora_weights=False)


def lora_model(family: str, settings: LoraSettings = SETTINGS):
    """A fresh float64 model (peft edits it in place, so never the shared fixture's)."""
    model = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager", seed=0)
    return apply_lora(model, settings)


@pytest.fixture(scope="module")
def setup():
    cache = {}

    def get(family):
        if family not in cache:
            model = lora_model(family)
            batch = mixed_batch()
            w = token_weights(batch, seed=11)
            cache[family] = (model, batch, w, per_sequence(model, batch, 0.7, w))
        return cache[family]

    return get


def check(actor, batch, w, ref):
    lp, ent, grads, _ = actor_run(actor, batch, 0.7, w)
    ref_lp, ref_ent, ref_grads = ref
    trainable = set(trainable_parameters(actor.model))
    assert trainable and all(".lora_" in n for n in trainable)
    assert set(ref_grads) == trainable, "the reference's gradients are not exactly the adapter weights"
    assert (lp - ref_lp).abs().max().item() < LP_ATOL
    assert (ent - ref_ent).abs().max().item() < LP_ATOL
    err, name = max_rel_grad_error(grads, ref_grads)
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e} relative"


@pytest.mark.parametrize(
    "family,split,attn",
    [(f, s, a) for f in FAMILIES for s, a in MODES]
    + [("tiny-qwen3-moe", True, "sdpa"), ("tiny-qwen3-moe", False, "sdpa")],
)
def test_dedup_lora_matches_per_sequence(setup, family, split, attn):
    model, batch, w, ref = setup(family)
    check(DeduplicatedActor(model=model, use_split_attention=split, attn_implementation=attn), batch, w, ref)


@pytest.mark.parametrize("padded", [False, True])
def test_baseline_lora_matches_per_sequence(setup, padded):
    model, batch, w, ref = setup("tiny-qwen3")
    check(BaselineActor(model=model, attn_implementation="sdpa", padded=padded), batch, w, ref)


def test_adapter_changes_the_result(setup):
    """The comparison sees the adapter: the same model without it gives other log-probs."""
    model, batch, w, ref = setup("tiny-qwen3")
    with model.disable_adapter():
        lp = DeduplicatedActor(model=model).forward(batch).log_probs.detach()
    assert (lp - ref[0]).abs().max().item() > 1e3 * LP_ATOL


def test_unwrap_keeps_adapters_in_the_graph(setup):
    model, *_ = setup("tiny-qwen3")
    inner = unwrap_adapters(model)
    assert inner is not model and unwrap_adapters(inner) is inner
    parts = model_parts(model)
    assert any(".lora_A" in n for n, _ in parts.base.named_parameters())


def test_lm_head_adapter_refused():
    with pytest.raises(ValueError, match="lm_head"):
        LoraSettings(target_modules=("q_proj", "lm_head"))
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="eager")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(UnsupportedModelError, match="lm_head"):
        DeduplicatedActor(model=wrapped)


def test_lora_dropout_refused_in_training():
    model = lora_model("tiny-qwen3", LoraSettings(r=2, dropout=0.1))
    model.train()
    actor = DeduplicatedActor(model=model)
    with pytest.raises(UnsupportedModelError, match="dropout"):
        actor.forward(mixed_batch())
    model.eval()
    actor.forward(mixed_batch())  # eval: dropout is off, so every copy is the same


@pytest.mark.parametrize("bad", [dict(r=0), dict(dropout=1.0), dict(quantize_base="int8")])
def test_bad_settings(bad):
    with pytest.raises(ValueError):
        LoraSettings(**bad)


def test_qlora_skips_with_reason_on_cpu():
    why = lora_unavailable(LoraSettings(quantize_base="nf4"), "cpu")
    assert why is not None and "CUDA" in why
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        apply_lora(model, LoraSettings(quantize_base="nf4"))


@pytest.mark.skipif(
    lora_unavailable(LoraSettings(quantize_base="nf4"), "cuda" if torch.cuda.is_available() else "cpu") is not None,
    reason=str(lora_unavailable(LoraSettings(quantize_base="nf4"), "cuda" if torch.cuda.is_available() else "cpu")),
)
def test_qlora_dedup_matches_baseline_gpu():
    """QLoRA on a GPU: 4-bit base, bf16 compute; dedup and the packed baseline agree to bf16 noise."""
    from zorro_core import create_dummy_batch

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa")
    model = apply_lora(model, LoraSettings(r=4, init_lora_weights=False, quantize_base="nf4"))
    assert any("Linear4bit" in type(m).__name__ for m in model.modules())
    batch = create_dummy_batch(
        batch_size=6, num_unique_prompts=2, prompt_len=32, response_len=16, vocab_size=256, vary_lengths=True, seed=1
    )
    results = []
    for actor_cls in (DeduplicatedActor, BaselineActor):
        model.zero_grad(set_to_none=True)
        out = actor_cls(model=model).forward(batch)
        out.log_probs.sum().backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.log_probs.detach().float(), grads))
    (lp_d, g_d), (lp_b, g_b) = results
    assert set(g_d) == set(trainable_parameters(model)) == set(g_b)
    assert (lp_d - lp_b).abs().max().item() < 0.15
    assert max_rel_grad_error(g_d, g_b)[0] < 0.1
