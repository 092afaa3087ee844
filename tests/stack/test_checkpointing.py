"""Gradient (activation) checkpointing: transformers' own switch, the actors in training mode.

`model.gradient_checkpointing_enable(...)` wraps each decoder layer's forward in
torch.utils.checkpoint; the backward recomputes the layer with the kwargs the forward got, the
zorro route included, so the recompute runs the same plan. Every family, both checkpoint
flavours (use_reentrant True/False), split and mask modes, padded and unpadded batches, the
padded baseline and LoRA: log-probs, entropy and every gradient equal the float64 per-sequence
reference, at test_actor's tolerances.
"""

import contextlib
import warnings

import pytest
import torch
from fla_devices import exact_kernels
from helpers import TINY_PRESETS, check
from test_actor import BATCHES

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.models.parts import model_parts
from zorro_core.models.presets import build_model, preset_config
from zorro_core.verify.reference import actor_run, per_sequence, token_weights

FAMILIES = TINY_PRESETS
LAYOUTS = ["dummy_padded", "dummy_unpadded"]
TEMPERATURE = 0.8


@contextlib.contextmanager
def checkpointing(model, reentrant: bool):
    """transformers' gradient checkpointing on `model` in training mode, then off and eval again."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable: renamed activation_... in 5.x
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    try:
        yield model
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()
        model.eval()


@pytest.fixture
def exact_kernel(monkeypatch):
    """Qwen3-Next, Qwen3.5: the float64 delta rule (transformers' kernel computes in float32; see test_families_linear)."""
    exact_kernels(monkeypatch)


@pytest.fixture(scope="module")
def models():
    """A float64 model per family, built for this module (checkpointing is switched on and off on it)."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = build_model(preset_config(family), dtype=torch.float64, attn_implementation="eager", seed=0)
        return cache[family]

    return get


def _reference(model, layout):
    batch = BATCHES[layout]()
    w = token_weights(batch, seed=1)
    return batch, w, per_sequence(model, batch, TEMPERATURE, w)  # plain forward, no checkpointing, eval mode


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointed_actors_match_per_sequence(models, exact_kernel, family, layout, reentrant):
    model = models(family)
    batch, w, ref = _reference(model, layout)
    actors = [
        lambda s=s, a=a: DeduplicatedActor(model=model, use_split_attention=s, attn_implementation=a)
        for s, a in ((True, "eager"), (True, "sdpa"), (False, "eager"))
    ]
    actors.append(lambda: BaselineActor(model=model, attn_implementation="sdpa"))
    if not model_parts(model).num_linear_layers:  # the padded baseline refuses linear-attention layers
        actors.append(lambda: BaselineActor(model=model, attn_implementation="eager", padded=True))
    with checkpointing(model, reentrant):
        for make in actors:
            check(make(), batch, w, ref, TEMPERATURE)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_runs_the_same_route(monkeypatch, reentrant):
    """The backward recomputes every attention layer through the hook with the forward's route
    (the count check after the forward is not confused by it), and checkpointing saves activations."""
    import zorro_core.attention.registration as registration

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="eager")
    seen = []
    real = registration.zorro_attention

    def spy(module, *args, **kwargs):
        seen.append(kwargs["zorro_route"])
        return real(module, *args, **kwargs)

    monkeypatch.setattr(registration, "zorro_attention", spy)
    batch = BATCHES["dummy_padded"]()
    actor = DeduplicatedActor(model=model)
    with checkpointing(model, reentrant):
        out = actor.forward(batch)
        n = model_parts(model).num_attention_layers
        assert len(seen) == n
        out.log_probs.sum().backward()
    assert len(seen) == 2 * n and all(r is seen[0] for r in seen)
    assert seen[0].plan is out.plan


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_lora_matches_per_sequence(reentrant):
    pytest.importorskip("peft", reason="peft is not installed (pip install 'zorro[lora]')")
    from test_lora import check as lora_check
    from test_lora import lora_model

    model = lora_model("tiny-qwen3")
    batch = BATCHES["dummy_padded"]()
    w = token_weights(batch, seed=11)
    ref = per_sequence(model, batch, 0.7, w)
    with checkpointing(model, reentrant):
        for split in (True, False):
            lora_check(
                DeduplicatedActor(model=model, use_split_attention=split, attn_implementation="sdpa"), batch, w, ref
            )
        lora_check(BaselineActor(model=model, attn_implementation="sdpa"), batch, w, ref)
        lora_check(BaselineActor(model=model, attn_implementation="sdpa", padded=True), batch, w, ref)


def test_checkpointing_changes_nothing_but_memory():
    """Sanity of the switch itself: with and without checkpointing the dedup actor gives the same gradients (bitwise
    for the non-reentrant flavour would be too strict: the recompute may reorder; 1e-12 relative)."""
    model = build_model(preset_config("tiny-llama"), dtype=torch.float64, attn_implementation="eager")
    batch = BATCHES["mixed"]()
    w = token_weights(batch, seed=1)
    model.train()
    plain = actor_run(DeduplicatedActor(model=model), batch, 1.0, w)
    with checkpointing(model, False):
        ckpt = actor_run(DeduplicatedActor(model=model), batch, 1.0, w)
    assert torch.allclose(plain[0], ckpt[0], rtol=0, atol=1e-14)
    for name, g in plain[2].items():
        assert torch.allclose(g, ckpt[2][name], rtol=1e-12, atol=1e-15), name


def test_router_aux_loss_under_checkpointing():
    """Non-reentrant: the MoE router aux loss and its gradient are those without checkpointing. Reentrant:
    transformers records router logits under no_grad, so the aux loss has no gradient (the baseline's neither);
    the README says so."""
    model = build_model(
        preset_config("tiny-qwen3-moe", output_router_logits=True), dtype=torch.float64, attn_implementation="eager"
    )
    batch = BATCHES["mixed"]()
    model.train()

    def aux_and_grads():
        model.zero_grad(set_to_none=True)
        out = DeduplicatedActor(model=model).forward(batch)
        out.aux_loss.backward()
        return out.aux_loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = aux_and_grads()
    with checkpointing(model, False):
        ckpt = aux_and_grads()
    assert torch.allclose(plain[0], ckpt[0], rtol=1e-12) and set(plain[1]) == set(ckpt[1]) and plain[1]
    for name, g in plain[1].items():
        assert torch.allclose(g, ckpt[1][name], rtol=1e-10, atol=1e-14), name
    with checkpointing(model, True):
        for actor in (DeduplicatedActor(model=model), BaselineActor(model=model)):
            assert not actor.forward(batch).aux_loss.requires_grad
