"""Vision-language prompts shared once: forward+backward of a small Qwen2.5-VL on CPU, a benchmark.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/vlm_sharing.py [--rounds 5] [--out results/vlm_sharing.csv]

A small Qwen2.5-VL (text: 4 layers, hidden 256, vocab 4096; vision tower: 4 blocks, hidden 128,
14-pixel patches, 112-pixel windows, the last block full attention), random weights, float32,
one torch thread. Each prompt: `--text-len` text tokens around one 448x448 image (32x32 patches,
256 image tokens after the 2x2 merge); `--group-size` responses per prompt, lengths drawn in
[R/2, R]. Arms, interleaved by the harness's timer (zorro_harness.bench.arms): "plain", the packed
per-row computation (BaselineVisionLanguageActor: every row's prompt and every image occurrence
computed), and "dedup" (VisionLanguageActor: each unique prompt once, each distinct image through
the vision tower once), and "hf_padded", what trainers run today: the model's own forward over the
padded batch with every row's pixel_values (its log-probs checked equal in tests/models/test_vlm.py's
benchmark case). The loss is a weighted sum of log-probs and entropies. Rows: each arm's
median [p20, p80] seconds, the speedup (ratio of medians, p20-p80 of the paired ratios), the cost
model's ideal (decoder FLOPs of both plans by zorro_core.plan.cost plus the vision tower's FLOPs,
zorro_core.models.vision.vision_flops, forward+backward = 3x forward) and speedup / ideal.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, Timings, Trial, main, paired_report, paired_rows

PATCH, MERGE, IMAGE_PX = 14, 2, 448


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompts", type=int, default=2, help="unique prompts (one image each)")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    ap.add_argument("--text-len", type=int, default=48, help="text tokens of a prompt besides the image")
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--image-px", type=int, default=IMAGE_PX, help="image side in pixels (a multiple of 28)")


def cases(args: argparse.Namespace) -> list[Case]:
    name = f"qwen2_5_vl-small:u{args.prompts}g{args.group_size}img{args.image_px}t{args.text_len}r{args.response_len}"
    return [Case(name, {"case": name})]


def small_config():
    from zorro_core.models.vision import tiny_config

    text = dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=4096,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 8, 8]},
    )
    vision = dict(
        depth=4,
        hidden_size=128,
        intermediate_size=256,
        num_heads=2,
        out_hidden_size=256,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[3],
    )
    return tiny_config(
        "qwen2_5_vl",
        text_config=text,
        vision_config=vision,
        image_token_id=4000,
        video_token_id=4001,
        vision_start_token_id=4002,
        vision_end_token_id=4003,
    )


def vision_batch(config, args: argparse.Namespace, seed: int = 0):
    """`prompts` prompts of one image each, `group_size` responses each, rows shuffled."""
    import torch

    from zorro_core.plan.batch import RolloutBatch
    from zorro_core.plan.multimodal import Image, MultimodalBatch

    g = torch.Generator().manual_seed(seed)
    side = args.image_px // PATCH
    tokens = side * side // (MERGE * MERGE)
    dim = 3 * 2 * PATCH * PATCH
    head = args.text_len * 2 // 3
    rows = []
    for _ in range(args.prompts):
        image = Image(torch.randn(side * side, dim, generator=g), (1, side, side))
        text = torch.randint(5, 3999, (args.text_len,), generator=g).tolist()
        prompt = text[:head] + [config.vision_start_token_id] + [config.image_token_id] * tokens
        prompt += [config.vision_end_token_id] + text[head:]
        for _ in range(args.group_size):
            n = int(torch.randint(args.response_len // 2, args.response_len + 1, (1,), generator=g))
            rows.append((prompt, (image,), torch.randint(5, 3999, (n,), generator=g).tolist()))
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in order]
    batch = RolloutBatch.from_lists([r[0] for r in rows], [r[2] for r in rows])
    return MultimodalBatch(batch, tuple(r[1] for r in rows))


def ideal_speedup(model, mm) -> float:
    """Forward+backward FLOPs of the plain computation over dedup's: decoder (both plans) and vision tower."""
    from zorro_core.models.registry import model_shape
    from zorro_core.models.vision import vision_flops
    from zorro_core.plan.cost import compare_plans
    from zorro_core.plan.multimodal import distinct_images, whole_prompt_groups
    from zorro_core.plan.prompt import build_prompt_plan

    distinct, ids = distinct_images(mm.images)
    dedup_plan = build_prompt_plan(mm.batch, group_of_row=whole_prompt_groups(mm.batch, ids))
    plain_plan = build_prompt_plan(mm.batch, dedup=False)
    decoder = compare_plans(model_shape(model.config), plain_plan, dedup_plan)
    visual = model.model.visual
    plain_vision = sum(vision_flops(visual, img.grid_thw) for row in mm.images for img in row)
    dedup_vision = sum(vision_flops(visual, img.grid_thw) for img in distinct)
    plain = decoder.baseline.forward_backward + 3 * plain_vision
    dedup = decoder.dedup.forward_backward + 3 * dedup_vision
    return plain / dedup


def padded_forward(model, mm):
    """What a trainer runs today: the model's own forward over the padded batch (every row's images)."""
    import torch

    from zorro_core.models.vision import token_types

    b = mm.batch
    ids = torch.cat([b.prompts, b.responses], 1)
    mask = torch.cat([b.prompt_mask, b.response_mask], 1)
    images = [img for row in mm.images for img in row]
    out = model(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=torch.cat([img.pixel_values for img in images]),
        image_grid_thw=torch.tensor([img.grid_thw for img in images]),
        mm_token_type_ids=token_types(ids, model.config),
        use_cache=False,
    )
    p = b.prompts.shape[1]
    logits = out.logits[:, p - 1 : -1]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    lp = logp.gather(-1, b.responses[..., None]).squeeze(-1) * b.response_mask
    ent = -(logp.exp() * logp).sum(-1) * b.response_mask
    return lp, ent


def setup(args: argparse.Namespace, cases: list[Case]) -> Any:
    import torch

    from zorro_core.models.vision import build_vision_model

    torch.set_num_threads(1)
    return build_vision_model(small_config(), dtype=torch.float32, seed=0)


def trial(model: Any, case: Case, args: argparse.Namespace) -> Trial:
    from zorro_core.actor.vision import BaselineVisionLanguageActor, VisionLanguageActor
    from zorro_core.verify.reference import loss_of, token_weights

    mm = vision_batch(model.config, args)
    weights = token_weights(mm.batch)

    def step(actor: Any):
        def run() -> None:
            out = actor(mm, calculate_entropy=True)
            loss_of(out.log_probs, out.entropy, weights).backward()

        return run

    def hf_padded() -> None:
        lp, ent = padded_forward(model, mm)
        loss_of(lp, ent, weights).backward()

    arms = {
        "plain": step(BaselineVisionLanguageActor(model=model)),
        "dedup": step(VisionLanguageActor(model=model)),
        "hf_padded": hf_padded,
    }
    return Trial(arms, between=lambda: model.zero_grad(set_to_none=True), ideal=ideal_speedup(model, mm))


def rows(case: Case, t: Timings, args: argparse.Namespace) -> list[dict[str, Any]]:
    # Against the padded forward the cost model has no ideal (it does not count padding).
    hf = Timings({k: t.samples[k] for k in ("hf_padded", "dedup")})
    return [
        {"case": case.id, **r}
        for r in paired_rows("forward_backward", t, "plain", "dedup")
        + paired_rows("forward_backward_vs_padded_hf", hf, "hf_padded", "dedup")
    ]


BENCH = Benchmark(
    name="vlm_sharing",
    doc=__doc__ or "",
    cases=cases,
    arms=("plain", "dedup", "hf_padded"),
    setup=setup,
    trial=trial,
    rows=rows,
    arguments=arguments,
    report=paired_report,
    quick={"prompts": 1, "group_size": 2, "image_px": 112, "response_len": 16, "text_len": 8, "rounds": 1, "warmup": 0},
    warmup=1,
    rounds=7,
)

if __name__ == "__main__":
    sys.exit(main(BENCH))
