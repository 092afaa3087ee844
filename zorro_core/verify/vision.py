"""Prove the vision path: VisionLanguageActor against each row run alone, per `zorro verify`'s rule.

One case is a vision-language family (a tiny random config built in code), a dtype, split or
mask attention, gradient checkpointing (none or a flavour) and a trainable or frozen vision
tower. Each case runs `vision_verify_batch` (several images per prompt, the same text with
another image, an image recurring across groups, one image as two tensors, a text-only row)
through the deduplicated vision actor and the plain one (every row its own prompt, every image
occurrence encoded) with a loss whose per-token weights differ per row, and compares their
log-probs, entropies and every parameter's gradient with each row run alone through the
unmodified model in float64 on the same weights (zorro_core.verify.vision_reference). The pass
rule is zorro_core.verify.gradients' RULE (`judge`). Both sharing modes: "prompt" (whole prompts,
text and images) on that batch, "prefix" (a token trie whose image placeholders are keyed by image
content) on `vision_prefix_batch`, whose rows share runs of text and images and diverge at a
different image of the same size.

`zorro verify gradients` runs these cases for the vision models of VISION_MODELS
(`run_verify_case`: a VerifyCase of layout "images" in, a CaseResult out).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from zorro_core.actor.config import ActorConfig
from zorro_core.actor.vision import BaselineVisionLanguageActor, VisionLanguageActor
from zorro_core.models.linear_attention import fla_available
from zorro_core.models.vision import VISION_FAMILIES, build_vision_model, tiny_config
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.dtypes import DTYPES as TORCH_DTYPES
from zorro_core.plan.multimodal import Image, MultimodalBatch
from zorro_core.stack.checkpointing import CHECKPOINTING, enable_checkpointing
from zorro_core.verify.delta_rule import exact_delta_rule
from zorro_core.verify.reference import loss_of, max_abs_error, rel_grad_errors, token_weights
from zorro_core.verify.rule import FACTOR, TEMPERATURE, CaseResult, Errors, VerifyCase, judge
from zorro_core.verify.vision_reference import vision_per_sequence

FAMILIES = tuple(sorted(VISION_FAMILIES))
DTYPES = ("float64", "float32", "bfloat16")
MODES = ("split", "mask")
SHARINGS = ("prompt", "prefix")
BUGS = ("text_positions",)
"""Planted to prove the check fails: "text_positions" gives the packed row 1-D text positions."""
VISION_MODELS = {
    "tiny-qwen2.5-vl": "qwen2_5_vl",
    "tiny-qwen3-vl": "qwen3_vl",
    "tiny-qwen3.5-vl": "qwen3_5",
    "tiny-qwen3.5-moe-vl": "qwen3_5_moe",
}
"""The names `zorro verify gradients --models` takes for the vision families (tiny configs built in code)."""
IMAGES_LAYOUT = "images"
"""The layout of a vision model's VerifyCase: the batches above (several images per prompt, ...)."""


@dataclass(frozen=True)
class VisionCase:
    """One configuration of the vision path to prove."""

    family: str
    """A served vision-language model type (zorro_core.models.vision.VISION_FAMILIES)."""
    dtype: str = "float64"
    """The model's dtype (the reference runs in float64 on a copy)."""
    mode: str = "split"
    """"split" (varlen calls) or "mask" (one attention with the block mask)."""
    checkpointing: Optional[str] = None
    """None, or a gradient checkpointing flavour (zorro_core.stack.checkpointing.CHECKPOINTING), in training mode."""
    frozen_tower: bool = False
    """The vision tower's parameters frozen (requires_grad False), as recipes often run."""
    sharing: str = "prompt"
    """The deduplicated actor's sharing: "prompt" (whole prompts) or "prefix" (a trie over whole rows)."""
    min_shared_tokens: int = 1
    """sharing="prefix": the shortest shared run split off (1: every common run, the strictest test)."""
    actor: Optional[ActorConfig] = None
    """The actors' other options (attention, varlen backend, logits mode); None: sdpa in split mode,
    eager in mask mode, the rest default. Its split/mask and sharing fields are this case's."""

    @property
    def name(self) -> str:
        parts = [self.family, self.dtype, self.mode]
        if self.sharing != "prompt":
            parts.append(self.sharing if self.min_shared_tokens == 1 else f"{self.sharing}:{self.min_shared_tokens}")
        if self.checkpointing:
            parts.append(f"ckpt-{self.checkpointing}")
        if self.frozen_tower:
            parts.append("frozen-tower")
        return "/".join(parts)


@dataclass
class VisionResult:
    """The verdict of one case."""

    case: VisionCase
    status: str
    """pass, fail or error."""
    reason: str = ""
    dedup: Optional[Errors] = None
    baseline: Optional[Errors] = None
    worst_ratio: float = float("nan")
    """The largest error / tolerance of the case (<= 1 passes)."""
    worst_check: str = ""
    failing: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _image_makers(
    config, seed: int, dtype: torch.dtype
) -> tuple[Callable[[int, int], Image], Callable[[Image], list[int]]]:
    """(`image(h, w)`: a random image of h x w patches of `config`'s tiny vision tower, drawn in call order
    from one generator seeded with `seed`; `placeholders(img)`: its tokens in a prompt, start, one image
    token per merged patch, end)."""
    g = torch.Generator().manual_seed(seed)
    merge = config.vision_config.spatial_merge_size
    dim = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2

    def image(h: int, w: int) -> Image:
        return Image(torch.randn(h * w, dim, generator=g, dtype=torch.float64).to(dtype), (1, h, w))

    def placeholders(img: Image) -> list[int]:
        t, h, w = img.grid_thw
        n = t * h * w // (merge * merge)
        return [config.vision_start_token_id] + [config.image_token_id] * n + [config.vision_end_token_id]

    return image, placeholders


def vision_verify_batch(config, seed: int = 0, dtype: torch.dtype = torch.float64) -> MultimodalBatch:
    """Groups {0, 1, 4} (row 4's image another tensor of the same content), {2} (row 0's text,
    another image), {3, 5} (two images, the first recurring from group 0), {6} (text only).
    Images have 2x2 patches of `config`'s tiny vision tower (24 values each)."""
    image, placeholders = _image_makers(config, seed, dtype)
    a, b, c = image(4, 4), image(4, 6), image(2, 4)
    a_copy = Image(a.pixel_values.clone(), a.grid_thw)
    t1, t2 = [5, 6, 7], [9, 10]
    rows = [
        (t1 + placeholders(a) + [8], (a,), [11, 12, 13]),
        (t1 + placeholders(a) + [8], (a,), [14, 15]),
        (t1 + placeholders(b) + [8], (b,), [16, 17, 18, 19]),
        (t2 + placeholders(a) + placeholders(c) + [3], (a, c), [20]),
        (t1 + placeholders(a_copy) + [8], (a_copy,), [21, 22]),
        (t2 + placeholders(a) + placeholders(c) + [3], (a, c), [23, 24, 25]),
        ([4, 5, 6, 7], (), [26, 27]),
    ]
    batch = RolloutBatch.from_lists([r[0] for r in rows], [r[2] for r in rows])
    return MultimodalBatch(batch, tuple(r[1] for r in rows))


def vision_prefix_batch(config, seed: int = 0, dtype: torch.dtype = torch.float64) -> MultimodalBatch:
    """Rows sharing prefixes of text and images: rows 0, 1, 6 and 8 share [t1, a, 8] (6 holds a as
    another tensor; 8's prompt ends there and its response runs on as 0's prompt does); row 2 is row
    0's tokens with another image b of a's size (they diverge at the image); rows 3 and 4 share a
    prompt of two images (a recurring, then c); row 5 shares [t2, a] with them and diverges where c
    starts; row 7 is text only."""
    image, placeholders = _image_makers(config, seed, dtype)
    a, b, c = image(4, 4), image(4, 4), image(2, 4)
    a_copy = Image(a.pixel_values.clone(), a.grid_thw)
    t1, t2 = [5, 6, 7], [9, 10]
    rows = [
        (t1 + placeholders(a) + [8, 30, 31], (a,), [11, 12, 13]),
        (t1 + placeholders(a) + [8, 32], (a,), [14, 15]),
        (t1 + placeholders(b) + [8, 30, 31], (b,), [16, 17, 18, 19]),
        (t2 + placeholders(a) + placeholders(c) + [3], (a, c), [20]),
        (t2 + placeholders(a) + placeholders(c) + [3], (a, c), [23, 24, 25]),
        (t2 + placeholders(a) + [3, 40], (a,), [21, 22]),
        (t1 + placeholders(a_copy) + [8, 30, 31], (a_copy,), [11, 12, 41]),
        ([4, 5, 6, 7], (), [26, 27]),
        (t1 + placeholders(a) + [8], (a,), [30, 31, 42]),
    ]
    batch = RolloutBatch.from_lists([r[0] for r in rows], [r[2] for r in rows])
    return MultimodalBatch(batch, tuple(r[1] for r in rows))


def vision_cases(
    families: Iterable[str] = FAMILIES,
    dtypes: Iterable[str] = DTYPES,
    modes: Iterable[str] = MODES,
    checkpointing: Iterable[Optional[str]] = (None,),
    frozen_tower: Iterable[bool] = (False,),
    sharings: Iterable[str] = ("prompt",),
) -> list[VisionCase]:
    """Every combination of the options, refusing an unknown value by name."""
    families, dtypes, modes = list(families), list(dtypes), list(modes)
    checkpointing, frozen_tower, sharings = list(checkpointing), list(frozen_tower), list(sharings)
    for name, values, allowed in (
        ("family", families, FAMILIES),
        ("dtype", dtypes, DTYPES),
        ("mode", modes, MODES),
        ("checkpointing", checkpointing, (None,) + CHECKPOINTING),
        ("sharing", sharings, SHARINGS),
    ):
        bad = [v for v in values if v not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad[0]!r}; choose from {', '.join(map(str, allowed))}")
    return [
        VisionCase(f, d, m, c, fr, sh)
        for f, sh, d, m, c, fr in itertools.product(families, sharings, dtypes, modes, checkpointing, frozen_tower)
    ]


def _errors(actor, mm: MultimodalBatch, weights, ref) -> Errors:
    model = actor.model
    model.zero_grad(set_to_none=True)
    out = actor(mm, temperature=TEMPERATURE, calculate_entropy=True)
    loss_of(out.log_probs, out.entropy, tuple(w.to(out.log_probs.device) for w in weights)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ref_lp, ref_ent, ref_grads = ref
    return Errors(
        max_abs_error(out.log_probs, ref_lp), max_abs_error(out.entropy, ref_ent), rel_grad_errors(grads, ref_grads)
    )


def _actor_config(case: VisionCase) -> ActorConfig:
    split = case.mode == "split"
    base = case.actor or ActorConfig(attn_implementation="sdpa" if split else "eager")
    return base.replace(
        use_split_attention=split,
        varlen_backend=base.varlen_backend if split else None,
        sharing=case.sharing,
        min_shared_tokens=case.min_shared_tokens,
        self_check=False,
    )


def run_vision_case(
    case: VisionCase, seed: int = 0, bug: Optional[str] = None, device: str = "cpu", factor: float = FACTOR
) -> VisionResult:
    """Prove one case (see the module doc); `bug` plants one of BUGS in the deduplicated actor only.
    The reference runs on the CPU in float64; the actors on `device` in the case's dtype."""
    if bug is not None and bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; choose from {', '.join(BUGS)}")
    start = time.perf_counter()
    try:
        config = tiny_config(case.family)
        options = _actor_config(case)
        attn = options.attn_implementation or "sdpa"
        # The reference runs eager or sdpa in float64 (a GPU kernel such as flash_attention_2 has no
        # float64); the actors' copy takes the case's attention.
        ref_attn = attn if attn in ("eager", "sdpa") else "sdpa"
        model64 = build_vision_model(config, dtype=torch.float64, seed=seed, attn_implementation=ref_attn)
        if case.frozen_tower:
            for p in model64.model.visual.parameters():
                p.requires_grad_(False)
        mm = (vision_prefix_batch if case.sharing == "prefix" else vision_verify_batch)(config, seed)
        weights = token_weights(mm.batch, seed)
        # ref64 is float64 throughout: gated DeltaNet layers (Qwen3.5) get the dtype-preserving delta
        # rule (transformers' computes in float32 whatever the dtype; a no-op for other families).
        with exact_delta_rule(model64):
            ref = vision_per_sequence(model64, mm, TEMPERATURE, weights=weights)
        model = copy.deepcopy(model64).to(device=device, dtype=TORCH_DTYPES[case.dtype])
        if attn != ref_attn:
            model.set_attn_implementation(attn)
        if case.checkpointing:
            enable_checkpointing(model, case.checkpointing)
            model.train()
        # float64 cases: the actors' delta rule in float64 too, as verify gradients' (not where fla's
        # kernel serves the device: it has no float64).
        fla_here = torch.device(device).type == "cuda" and fla_available() is None
        exact = case.dtype == "float64" and not fla_here
        with exact_delta_rule(model) if exact else contextlib.nullcontext():
            baseline = _errors(BaselineVisionLanguageActor(model=model, config=options), mm, weights, ref)
            dedup_actor = VisionLanguageActor(model=model, config=options)
            with _text_positions() if bug == "text_positions" else contextlib.nullcontext():
                dedup = _errors(dedup_actor, mm, weights, ref)
    except Exception as e:  # a case that cannot run counts as a failure, with its reason
        return VisionResult(case, "error", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - start)
    worst, check, failing = judge(case.dtype, dedup, baseline, factor)
    return VisionResult(
        case,
        "fail" if failing else "pass",
        "; ".join(failing[:3]),
        dedup,
        baseline,
        worst,
        check,
        failing,
        time.perf_counter() - start,
    )


def vision_verify_case(case: VerifyCase, checkpointing: Optional[str] = None) -> VisionCase:
    """The VisionCase of a `zorro verify gradients` case whose model is one of VISION_MODELS."""
    a = case.actor
    return VisionCase(
        VISION_MODELS[case.model],
        case.dtype,
        "split" if a.use_split_attention else "mask",
        checkpointing,
        False,
        a.sharing,
        a.min_shared_tokens,
        a,
    )


def run_verify_case(
    case: VerifyCase,
    device: str = "cpu",
    seed: int = 0,
    factor: float = FACTOR,
    bug: Optional[str] = None,
    checkpointing: Optional[str] = None,
) -> CaseResult:
    """A `zorro verify gradients` case of a vision model, proved by `run_vision_case`. `bug` (any of
    verify's planted plan bugs) plants this path's own, "text_positions": 1-D text positions in
    place of the 3-D mRoPE, which every vision case must fail."""
    result = run_vision_case(
        vision_verify_case(case, checkpointing), seed, "text_positions" if bug else None, device, factor
    )
    dedup, base = result.dedup, result.baseline
    return CaseResult(
        case,
        result.status,
        result.reason,
        dedup,
        base,
        float("nan"),
        result.worst_ratio,
        result.worst_check,
        result.seconds,
    )


class _text_positions:
    """Within: the vision actor gives the packed row 1-D text positions (the planted bug)."""

    def __enter__(self) -> None:
        import zorro_core.actor.vision as actor_vision

        self._module = actor_vision
        self._saved = actor_vision.mrope_positions, actor_vision.trie_mrope_positions
        actor_vision.mrope_positions = lambda plan, *args: plan.position_ids.expand(3, -1)
        actor_vision.trie_mrope_positions = lambda plan, *args: plan.position_ids.expand(3, -1)

    def __exit__(self, *exc: object) -> None:
        self._module.mrope_positions, self._module.trie_mrope_positions = self._saved
