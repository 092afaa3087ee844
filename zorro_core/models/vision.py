"""The vision-language families: what the dedup path calls of their own code, and what it refuses.

A served family's composite model (`*ForConditionalGeneration`) is run in three of its own
pieces: the vision tower (`get_image_features`, once per distinct image of the call), its
`get_rope_index` (once per unique prompt: the 3-D mRoPE positions, and where the text after the
prompt continues), and its text decoder (`language_model`, over the packed row through the
attention hook). Between them zorro only places rows: image embeddings into the placeholder
positions of each unique prompt (`masked_scatter`, as the model does) and, for Qwen3-VL, the
deepstack features at the same positions.

Served: Qwen2.5-VL, Qwen3-VL and Qwen3.5 (dense and MoE; their gated DeltaNet layers through the
linear-attention adapter, as for text) with images. Refused with the reason: video inputs (a
video's temporal positions are spaced by its frame times, not served), image tokens inside a
response, and every other vision-language family (Gemma 3's bidirectional image attention,
Qwen2-VL and Qwen3-VL-MoE untested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

from zorro_core.errors import UnsupportedModelError
from zorro_core.models.parts import unwrap_adapters
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.multimodal import Image


@dataclass(frozen=True)
class VisionFamily:
    """What differs between the served vision-language families."""

    model_type: str
    """transformers' config.model_type of the composite."""
    deepstack: bool = False
    """Whether the vision tower's intermediate features are added to the first decoder layers' outputs
    at the image positions (Qwen3-VL's deepstack)."""


VISION_FAMILIES = {
    f.model_type: f
    for f in (
        VisionFamily("qwen2_5_vl"),
        VisionFamily("qwen3_vl", deepstack=True),
        # Qwen3.5 (dense, MoE): Qwen3-VL's tower without deepstack; the text decoder's gated DeltaNet
        # layers take the route through the linear-attention adapter, as for text.
        VisionFamily("qwen3_5"),
        VisionFamily("qwen3_5_moe"),
    )
}

REFUSED_VISION = {
    "qwen2_vl": "Qwen2-VL is not tested by zorro's vision path",
    "qwen3_vl_moe": "Qwen3-VL-MoE is not tested by zorro's vision path (its router aux loss is not weighted here)",
    "gemma3": "Gemma 3 attends bidirectionally inside an image, outside the causal plan",
}


def vision_family(model: nn.Module) -> VisionFamily:
    """The vision family of `model`, refusing (naming the reason) one whose images are not served."""
    model_type = getattr(getattr(unwrap_adapters(model), "config", None), "model_type", None)
    if model_type in VISION_FAMILIES:
        return VISION_FAMILIES[model_type]
    why = REFUSED_VISION.get(model_type or "", "it is not a vision-language model zorro serves")
    raise UnsupportedModelError(
        f"images with model type {model_type!r} are not served by the dedup path: {why} "
        f"(served: {', '.join(sorted(VISION_FAMILIES))})"
    )


def image_tokens(img: Image, merge: int) -> int:
    """Placeholder tokens of an image in the prompt: its patches over the spatial merge."""
    t, h, w = img.grid_thw
    if h % merge or w % merge:
        raise ValueError(f"image grid {img.grid_thw} is not divisible by the spatial merge size {merge}")
    return t * h * w // (merge * merge)


def check_images(batch: RolloutBatch, images: Sequence[Sequence[Image]], config) -> None:
    """Refuse what the vision path would compute wrong: a video token anywhere, an image token in a
    response, a prompt whose image placeholders do not number its images' tokens."""
    image_id, video_id = config.image_token_id, config.video_token_id
    merge = config.vision_config.spatial_merge_size
    if bool((batch.responses[batch.response_mask.bool()] == image_id).any()) or bool(
        (batch.responses[batch.response_mask.bool()] == video_id).any()
    ):
        raise ValueError("a response holds an image or video placeholder token: only prompts carry images")
    prompts = torch.where(batch.prompt_mask.bool(), batch.prompts, -1)
    if bool((prompts == video_id).any()):
        raise UnsupportedModelError(
            "video inputs are not served by the dedup path (their temporal positions follow the frames' times)"
        )
    counts = (prompts == image_id).sum(1).tolist()
    for i, (n, row) in enumerate(zip(counts, images)):
        needs = [image_tokens(img, merge) for img in row]
        if n != sum(needs):
            raise ValueError(
                f"prompt of row {i} holds {n} image placeholder tokens, its {len(row)} images need {sum(needs)}"
            )
        # The model numbers each run of placeholders as the next image (its get_rope_index): a run per
        # image, of that image's tokens, else the positions (and transformers' iterator) go wrong.
        runs = placeholder_runs(prompts[i] == image_id) if n else []
        if runs != needs:
            raise ValueError(
                f"prompt of row {i}: its image placeholders come in runs of {runs} tokens, its {len(row)} images "
                f"need one run each of {needs} (t*h*w / merge^2 of each image, in order)"
            )


def placeholder_runs(is_image: torch.Tensor) -> list[int]:
    """The lengths of the runs of True in a 1-D bool row, in order."""
    edges = torch.diff(torch.cat([is_image.new_zeros(1), is_image, is_image.new_zeros(1)]).to(torch.int8))
    starts, ends = (edges == 1).nonzero().flatten(), (edges == -1).nonzero().flatten()
    return (ends - starts).tolist()


def token_types(ids: torch.Tensor, config) -> torch.Tensor:
    """The model's mm_token_type_ids of a token row: 1 at image placeholders, 2 at video ones, else 0
    (what the processor gives)."""
    return (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()


def prompt_positions(
    base: Any, prompt: torch.Tensor, grids: Sequence[tuple[int, int, int]]
) -> tuple[torch.Tensor, int]:
    """The model's own positions of one prompt ([3, L], its get_rope_index) and the position of the
    first text token after it (the index's numbering of one more text token)."""
    config = base.config
    ids = torch.cat([prompt, prompt.new_zeros(1)])[None]  # one text token more: where the response starts
    types = token_types(ids, config)
    types[0, -1] = 0
    grid = torch.tensor(grids, dtype=torch.long, device=prompt.device) if grids else None
    pos, _ = base.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
    nxt = pos[:, 0, -1]
    if not bool((nxt == nxt[0]).all()):
        raise UnsupportedModelError(f"the model numbers text after a prompt unevenly ({nxt.tolist()})")
    return pos[:, 0, :-1], int(nxt[0])


def encode_images(
    base: Any, images: Sequence[Image], family: VisionFamily
) -> tuple[list[torch.Tensor], Optional[list[list[torch.Tensor]]]]:
    """Each image through the vision tower (one call for all): its embeddings, and with deepstack its
    features per deepstack layer (`[layer][image]`)."""
    if not images:
        return [], ([] if family.deepstack else None)
    pixel_values = torch.cat([img.pixel_values for img in images]).to(base.visual.device)
    grid = torch.tensor([img.grid_thw for img in images], dtype=torch.long, device=pixel_values.device)
    out: Any = base.get_image_features(pixel_values, grid)
    embeds = list(out.pooler_output)
    deep = None
    if family.deepstack:
        # transformers splits each deepstack layer per image from some 5.x on; 5.10 gives one
        # [image tokens, hidden] tensor per layer: split it the way the embeddings are split.
        sizes = [e.shape[0] for e in embeds]
        deep = [
            list(torch.split(layer, sizes)) if torch.is_tensor(layer) else list(layer)
            for layer in out.deepstack_features
        ]
    return embeds, deep


def tiny_config(model_type: str, **overrides: Any):
    """A tiny random config of a served vision-language family (tests, the CPU benchmark): two decoder
    layers, a two-block vision tower with 2x2 patches (pixel rows of 3*2*2*2 = 24 values)."""
    from transformers import AutoConfig

    text = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]},
    )
    # The vision tower's fields every family shares; each family adds its own below.
    tower: dict[str, Any] = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if model_type == "qwen2_5_vl":
        vision = dict(tower, window_size=8, fullatt_block_indexes=[1])
    elif model_type in ("qwen3_5", "qwen3_5_moe"):
        # Qwen3.5's tiny text preset (two layers: gated DeltaNet, then full attention), at the width of
        # the other families' tiny decoders; the tower is Qwen3-VL's without deepstack.
        text = dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            full_attention_interval=2,
            vocab_size=256,
            max_position_embeddings=4096,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
        if model_type == "qwen3_5_moe":
            text.update(
                moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2
            )
        else:
            text.update(intermediate_size=128)
        vision = dict(tower, num_position_embeddings=64)
    elif model_type == "qwen3_vl":
        text.update(head_dim=16)
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 1e4,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        }
        vision = dict(tower, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
    else:
        raise ValueError(f"no tiny config for {model_type!r} (served: {', '.join(sorted(VISION_FAMILIES))})")
    fields: dict[str, Any] = dict(
        text_config=text,
        vision_config=vision,
        image_token_id=250,
        video_token_id=251,
        vision_start_token_id=252,
        vision_end_token_id=253,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return type(AutoConfig.for_model(model_type))(**fields)


def build_vision_model(config, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation: str = "sdpa"):
    """A vision-language model from `config` with seeded random weights (the caller's RNG state kept).
    MoE experts run "eager" in float64, as build_model's (grouped_mm has no float64 kernel)."""
    from transformers import AutoModelForImageTextToText

    from zorro_core.models.moe import routed_experts
    from zorro_core.models.presets import seeded_rng

    extra = {}
    if dtype == torch.float64 and routed_experts(config.get_text_config()):
        extra["experts_implementation"] = "eager"
    with seeded_rng(seed):
        return AutoModelForImageTextToText.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation, **extra
        )


def _linear_weights(module: Any) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv3d)))


def _window_lengths(grid: tuple[int, int, int], config) -> list[int]:
    """Qwen2.5-VL's window attention: the patches of each window, as transformers partitions them."""
    from transformers.vision_utils import get_vision_window_index

    _, cu = get_vision_window_index(
        torch.tensor([grid]), config.spatial_merge_size, config.window_size, config.patch_size
    )
    return [n for n in torch.as_tensor(cu).diff().tolist() if n > 0]


def vision_flops(visual: Any, grid: tuple[int, int, int]) -> float:
    """Forward FLOPs of one image through the vision tower, counted as zorro_core.plan.cost counts the
    decoder: 2 x the weights each patch goes through (patch embedding, every block), 2 x 2 x width per
    attended pair per block (QK^T and PV; a windowed block's pairs within its windows), 2 x the merger
    weights per merged token (and Qwen3-VL's deepstack mergers). Norms, rotary and softmax ignored."""
    config = visual.config
    patches = grid[0] * grid[1] * grid[2]
    merged = patches // (config.spatial_merge_size**2)
    blocks = visual.blocks
    per_patch = _linear_weights(visual.patch_embed) + _linear_weights(blocks)
    mergers = _linear_weights(visual.merger) + sum(
        _linear_weights(m) for m in getattr(visual, "deepstack_merger_list", ())
    )
    full_blocks = set(getattr(config, "fullatt_block_indexes", range(len(blocks))))
    windowed = sum(x * x for x in _window_lengths(grid, config)) if len(full_blocks) < len(blocks) else 0
    pairs = sum(patches * patches if i in full_blocks else windowed for i in range(len(blocks)))
    return 2.0 * per_patch * patches + 4.0 * config.hidden_size * pairs + 2.0 * mergers * merged
