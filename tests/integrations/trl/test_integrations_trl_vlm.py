"""DedupGRPOTrainer's vision inputs against the real trl.GRPOTrainer on CPU (tiny Qwen2.5-VL, Qwen3-VL,
Qwen3.5 dense and MoE).

float64: `_get_per_token_logps_and_entropies` with TRL's vision kwargs (pixel_values,
image_grid_thw, num_images, mm_token_type_ids) equals GRPOTrainer's own method on the same inputs
and each row run alone through the model (zorro_core.verify.vision_reference): log-probs,
entropies and every parameter's gradient, the vision tower's included, at zorro's float64
tolerances; served, nothing falling back. What is not served falls back with the reason.

The processor is a ProcessorMixin holding only the tokenizer (GRPOTrainer reads its tokenizer at
construction; the log-prob method never calls it): the Qwen-VL processors need torchvision,
which the project's environment does not install. No generation or train() step with images is
run here.
"""

from __future__ import annotations

import functools

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402 (after the skip: trl is an optional extra)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, ProcessorMixin  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from zorro_core.actor.config import ActorConfig  # noqa: E402
from zorro_core.integrations.trl import DedupFallbackWarning, DedupGRPOTrainer  # noqa: E402
from zorro_core.models.vision import build_vision_model, tiny_config, token_types  # noqa: E402
from zorro_core.plan.batch import RolloutBatch  # noqa: E402
from zorro_core.plan.multimodal import Image, MultimodalBatch  # noqa: E402
from zorro_core.verify.delta_rule import exact_delta_rule  # noqa: E402
from zorro_core.verify.gradients import GRAD_FLOOR, LP_FLOOR  # noqa: E402
from zorro_core.verify.reference import rel_grad_errors  # noqa: E402
from zorro_core.verify.vision_reference import vision_per_sequence  # noqa: E402

IMAGE, START, END = 250, 252, 253
TEMPERATURE = 0.7


class _TokenizerOnly(ProcessorMixin):
    """A processor with a tokenizer only (module doc)."""

    attributes = ["tokenizer"]
    tokenizer_class = "PreTrainedTokenizerFast"


def _processor() -> ProcessorMixin:
    vocab = {f"w{i}": i for i in range(250)}
    vocab.update({"<|image_pad|>": 250, "<|video_pad|>": 251, "<|vision_start|>": 252, "<|vision_end|>": 253})
    vocab.update({"<pad>": 0, "<eos>": 2})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return _TokenizerOnly(
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="w1")
    )


def _trainer(model, tmp_path, zorro_config=None):
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        gradient_checkpointing=False,
        bf16=False,
        beta=0.0,
        temperature=TEMPERATURE,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
    )
    return DedupGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w5 w6", "w7 w8"]}),
        processing_class=_processor(),
        zorro_config=zorro_config,
    )


def _joined_inputs():
    """TRL's layout with images: groups out of order, an image recurring across groups, two images in
    one prompt, a text-only row, a fully masked completion."""
    g = torch.Generator().manual_seed(0)

    def image(h, w):
        return Image(torch.randn(h * w, 24, generator=g, dtype=torch.float64), (1, h, w))

    def ph(img):
        return [START] + [IMAGE] * (img.grid_thw[1] * img.grid_thw[2] // 4) + [END]

    a, b, c = image(4, 4), image(4, 6), image(2, 4)
    rows = [
        ([5, 6] + ph(a) + [8], (a,), [40, 41, 2]),
        ([5, 6] + ph(b) + [8], (b,), [42, 43, 44, 45]),
        ([5, 6] + ph(a) + [8], (a,), [46]),
        ([9] + ph(a) + ph(c), (a, c), [47, 48]),
        ([5, 6] + ph(b) + [8], (b,), [49, 50, 51]),
        ([11, 12, 13], (), [52, 53]),
        ([9] + ph(a) + ph(c), (a, c), [54, 55, 56]),
    ]
    p, r = max(len(x[0]) for x in rows), max(len(x[2]) for x in rows)
    ids = torch.zeros(len(rows), p + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (pr, _, co) in enumerate(rows):
        ids[i, p - len(pr) : p] = torch.tensor(pr)
        ids[i, p : p + len(co)] = torch.tensor(co)
        mask[i, p - len(pr) : p + len(co)] = 1
    mask[4, p:] = 0  # mask_truncated_completions
    images = [img for _, imgs, _ in rows for img in imgs]
    vision = dict(
        pixel_values=torch.cat([img.pixel_values for img in images]),
        image_grid_thw=torch.tensor([img.grid_thw for img in images]),
        num_images=[len(imgs) for _, imgs, _ in rows],
    )
    return ids, mask, r, vision, [imgs for _, imgs, _ in rows]


def _run(fn, model, ids, mask, keep, weights, **kwargs):
    model.zero_grad(set_to_none=True)
    lp, ent, aux = fn(model, ids, mask, keep, compute_entropy=True, **kwargs)
    ((lp * weights).sum() + (ent * weights.flip(0)).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), ent.detach(), aux, grads


def _reference(model, ids, mask, keep, images, weights):
    """Each row alone (its own pixel_values) through the model; rows with no completion token are 0."""
    p = ids.shape[1] - keep
    live = mask[:, p:].bool().any(1).nonzero().flatten()
    batch = RolloutBatch(ids[live, :p], mask[live, :p], ids[live, p:], mask[live, p:])
    mm = MultimodalBatch(batch, tuple(images[i] for i in live.tolist()))
    w = (weights[live], weights.flip(0)[live])
    lp, ent, grads = vision_per_sequence(model, mm, TEMPERATURE, weights=w)
    full_lp, full_ent = torch.zeros(ids.shape[0], keep, dtype=lp.dtype), torch.zeros(ids.shape[0], keep, dtype=lp.dtype)
    full_lp[live], full_ent[live] = lp, ent
    return full_lp, full_ent, None, grads


@pytest.mark.parametrize(
    "family,batch_size,sharing",
    [(f, b, "prompt") for f in ("qwen2_5_vl", "qwen3_vl") for b in (None, 3)]
    + [(f, None, "prefix") for f in ("qwen2_5_vl", "qwen3_vl")]
    + [(f, None, s) for f in ("qwen3_5", "qwen3_5_moe") for s in ("prompt", "prefix")],
)
def test_vision_logps_equal_trl_float64(tmp_path, family, batch_size, sharing):
    """sharing="prefix": rows share runs of text and images (zorro_core.plan.multimodal's image trie).
    Qwen3.5 (gated DeltaNet layers): every forward of the model, TRL's, zorro's and the reference's, runs
    the float64 delta rule (transformers' PyTorch kernel computes in float32 even in a float64 model)."""
    model = build_vision_model(tiny_config(family), torch.float64)
    trainer = _trainer(model, tmp_path, ActorConfig(sharing=sharing, min_shared_tokens=1))
    model = trainer.model
    model.train()
    with exact_delta_rule(model):
        _check_vision_logps(trainer, model, batch_size, sharing)


def _check_vision_logps(trainer, model, batch_size, sharing):
    ids, mask, keep, vision, images = _joined_inputs()
    vision["mm_token_type_ids"] = token_types(ids, model.config)
    weights = torch.rand(ids.shape[0], keep, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
    trl_fn = functools.partial(GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    trl_out = _run(trl_fn, model, ids, mask, keep, weights, batch_size=batch_size, **vision)
    ours = _run(
        trainer._get_per_token_logps_and_entropies, model, ids, mask, keep, weights, batch_size=batch_size, **vision
    )
    ref = _reference(model, ids, mask, keep, images, weights)
    assert ours[0].shape == (ids.shape[0], keep) and ours[2] is None
    for other in (trl_out, ref):
        real = mask[:, -keep:].bool()
        assert (ours[0] - other[0])[real].abs().max() <= LP_FLOOR
        assert (ours[1] - other[1])[real].abs().max() <= LP_FLOOR
        errs = rel_grad_errors(ours[3], other[3])
        assert any(n.startswith("model.visual.") for n in errs)
        assert max(errs.values()) <= GRAD_FLOOR, max(errs.items(), key=lambda kv: kv[1])
    assert float(ours[0][4].abs().max()) == 0.0
    assert trainer.zorro_calls == {"dedup": 1, "fallback": 0}
    assert trainer.zorro_log[-1]["images"] == 8
    assert trainer._actor_for(model).config.sharing == sharing


def test_unserved_vision_inputs_fall_back_with_the_reason(tmp_path):
    trainer = _trainer(build_vision_model(tiny_config("qwen2_5_vl"), torch.float64), tmp_path)
    model = trainer.model
    ids, mask, keep, vision, _ = _joined_inputs()
    no_types = dict(vision)
    vision["mm_token_type_ids"] = token_types(ids, model.config)
    trl_fn = functools.partial(GRPOTrainer._get_per_token_logps_and_entropies, trainer)
    wrong_types = token_types(ids, model.config)
    wrong_types[0, 0] = 1
    cases = [
        (dict(vision, mm_token_type_ids=wrong_types), "mm_token_type_ids differ"),
        (dict(vision, pixel_attention_mask=torch.ones(3)), r"multimodal inputs \(pixel_attention_mask\)"),
        (dict(vision, num_images=vision["num_images"][:-1] + [3]), "do not describe the same images"),
        (no_types, "images without mm_token_type_ids are not served"),
    ]
    with torch.no_grad():
        for kwargs, why in cases:
            with pytest.warns(DedupFallbackWarning, match=why):
                try:
                    trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, **kwargs)
                except (RuntimeError, ValueError, TypeError, IndexError):  # TRL's own code refusing it too
                    pass
        out = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, **vision)[0]
        assert (out - trl_fn(model, ids, mask, keep, **vision)[0].double()).abs().max() <= LP_FLOOR
    assert trainer.zorro_calls["fallback"] == 4 and trainer.zorro_calls["dedup"] == 1
