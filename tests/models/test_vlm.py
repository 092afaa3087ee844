"""Vision-language prompts shared once (issue 48): Qwen2.5-VL and Qwen3-VL with images.

Every case compares against each row run alone through the unmodified model with its own
pixel_values in float64 (zorro_core.verify.vision_reference): log-probs, entropy and every
parameter's gradient, the vision tower's included. The batch has several images per prompt, the
same text with different images, an image recurring across groups and one image passed as two
tensor objects.
"""

import pytest
import torch

from zorro_core.actor.vision import BaselineVisionLanguageActor, VisionLanguageActor
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.vision import build_vision_model, tiny_config
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.multimodal import Image, MultimodalBatch, distinct_images, whole_prompt_groups
from zorro_core.stack.checkpointing import CHECKPOINTING, enable_checkpointing
from zorro_core.verify.reference import loss_of, max_rel_grad_error, token_weights
from zorro_core.verify.tolerances import GRAD_RTOL, LOGPROB_ATOL
from zorro_core.verify.vision_reference import vision_per_sequence

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
IMAGE, VIDEO, START, END = 250, 251, 252, 253
# (use_split_attention, attn_implementation, varlen_backend)
MODES = [(True, "sdpa", None), (True, "sdpa", "flash_cpu"), (False, "eager", None)]


def _image(g: torch.Generator, h: int, w: int) -> Image:
    return Image(torch.randn(h * w, 24, generator=g, dtype=torch.float64), (1, h, w))


def _placeholders(img: Image) -> list[int]:
    t, h, w = img.grid_thw
    return [START] + [IMAGE] * (t * h * w // 4) + [END]


def vision_batch(seed: int = 0) -> MultimodalBatch:
    """Groups: {0, 1, 4} (row 4's image another tensor of the same content), {2} (same text as 0,
    another image), {3, 5} (two images, the first recurring from group 0), {6} (text only)."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = _image(g, 4, 4), _image(g, 4, 6), _image(g, 2, 4)
    a_copy = Image(a.pixel_values.clone(), a.grid_thw)
    t1, t2 = [5, 6, 7], [9, 10]
    rows = [
        (t1 + _placeholders(a) + [8], (a,), [11, 12, 13]),
        (t1 + _placeholders(a) + [8], (a,), [14, 15]),
        (t1 + _placeholders(b) + [8], (b,), [16, 17, 18, 19]),
        (t2 + _placeholders(a) + _placeholders(c) + [3], (a, c), [20]),
        (t1 + _placeholders(a_copy) + [8], (a_copy,), [21, 22]),
        (t2 + _placeholders(a) + _placeholders(c) + [3], (a, c), [23, 24, 25]),
        ([4, 5, 6, 7], (), [26, 27]),
    ]
    batch = RolloutBatch.from_lists([r[0] for r in rows], [r[2] for r in rows])
    return MultimodalBatch(batch, tuple(r[1] for r in rows))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


def _model(family: str, attn: str = "sdpa"):
    return build_vision_model(tiny_config(family), dtype=torch.float64, attn_implementation=attn)


def _run(actor, mm, w):
    model = actor.model
    model.zero_grad(set_to_none=True)
    out = actor(mm, calculate_entropy=True)
    loss_of(out.log_probs, out.entropy, w).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def _errors(actor, mm, ref=None):
    w = token_weights(mm.batch)
    out, grads = _run(actor, mm, w)
    rlp, rent, rgrads = ref if ref is not None else vision_per_sequence(actor.model, mm, weights=w)
    lp_err = (out.log_probs.detach() - rlp).abs().max().item()
    ent_err = (out.entropy.detach() - rent).abs().max().item()
    g_err, g_name = max_rel_grad_error(grads, rgrads)
    return out, lp_err, ent_err, g_err, g_name, grads


def _assert_exact(actor, mm):
    out, lp_err, ent_err, g_err, g_name, grads = _errors(actor, mm)
    assert lp_err < LOGPROB_ATOL, f"log-prob error {lp_err:.2e}"
    assert ent_err < LOGPROB_ATOL, f"entropy error {ent_err:.2e}"
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e} relative"
    return out, grads


@pytest.mark.parametrize("split,attn,backend", MODES)
def test_images_shared_once_equal_each_row_alone(family, split, attn, backend):
    model = _model(family, attn)
    actor = VisionLanguageActor(model=model, use_split_attention=split, varlen_backend=backend)
    out, grads = _assert_exact(actor, vision_batch())
    assert out.plan.group_of_row.tolist() == [0, 0, 1, 2, 0, 2, 3]
    assert any(n.startswith("model.visual.") for n in grads), "the vision tower got no gradient"


def test_the_plain_vision_actor_equals_each_row_alone(family):
    _assert_exact(BaselineVisionLanguageActor(model=_model(family)), vision_batch(1))


@pytest.mark.parametrize("flavour", CHECKPOINTING)
def test_gradient_checkpointing_and_a_frozen_vision_tower(family, flavour):
    model = _model(family)
    enable_checkpointing(model, flavour)
    model.train()
    assert model.model.language_model.gradient_checkpointing
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    _, grads = _assert_exact(VisionLanguageActor(model=model), vision_batch(2))
    assert not any(n.startswith("model.visual.") for n in grads)


def test_each_distinct_image_goes_through_the_vision_tower_once(family):
    model = _model(family)
    seen = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["grid_thw"].shape[0]), with_kwargs=True
    )
    mm = vision_batch()
    VisionLanguageActor(model=model)(mm)
    # a, b and c: a recurs in three groups' prompts and as another tensor object.
    assert seen == [3]
    seen.clear()
    BaselineVisionLanguageActor(model=model)(mm)
    assert seen == [sum(len(r) for r in mm.images)]


def test_text_only_batches_go_the_text_way(family):
    model = _model(family)
    mm = vision_batch()
    text_rows = [i for i, r in enumerate(mm.images) if not r]
    ps, rs = mm.batch.to_lists()
    batch = RolloutBatch.from_lists([ps[i] for i in text_rows] * 3, [rs[i] for i in text_rows] * 3)
    _assert_exact(VisionLanguageActor(model=model), MultimodalBatch(batch, ((),) * batch.batch_size))
    out = VisionLanguageActor(model=model)(batch, calculate_entropy=True)
    ref = vision_per_sequence(model, MultimodalBatch(batch, ((),) * batch.batch_size))
    assert (out.log_probs.detach() - ref[0]).abs().max().item() < LOGPROB_ATOL


def test_grouping_compares_images_by_content():
    g = torch.Generator().manual_seed(0)
    a, b = _image(g, 2, 2), _image(g, 2, 2)
    a_again = Image(a.pixel_values.clone(), a.grid_thw)
    other_grid = Image(a.pixel_values.clone(), (1, 1, 4))
    distinct, ids = distinct_images([(a,), (a_again,), (b,), (other_grid,), (a, b)])
    assert ids == [[0], [0], [1], [2], [0, 1]] and len(distinct) == 3
    _, plain = distinct_images([(a,), (a_again,)], share=False)
    assert plain == [[0], [1]]
    batch = RolloutBatch.from_lists([[1, 2]] * 4, [[3]] * 4)
    assert whole_prompt_groups(batch, [[0], [0], [1], []]).tolist() == [0, 0, 1, 2]


def test_bad_images_are_refused():
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="grid_thw .* holds 4 patches, pixel_values 3"):
        Image(torch.zeros(3, 24), (1, 2, 2))
    with pytest.raises(ValueError, match="floating-point"):
        Image(torch.zeros(4, 24, dtype=torch.long), (1, 2, 2))
    batch = RolloutBatch.from_lists([[1, 2]], [[3]])
    with pytest.raises(ValueError, match="images are given for 2 rows, the batch has 1"):
        MultimodalBatch(batch, ((), ()))
    with pytest.raises(ValueError, match="does not add up"):
        MultimodalBatch.from_processor(batch, torch.zeros(4, 24), torch.tensor([[1, 2, 2]]), [2])
    img = _image(g, 2, 2)
    mm = MultimodalBatch.from_processor(batch, img.pixel_values, torch.tensor([[1, 2, 2]]), [1])
    assert mm.images[0][0].same_content(img)


@pytest.mark.parametrize(
    "prompt,response,error,match",
    [
        ([5, START, IMAGE, END], [IMAGE], ValueError, "response holds an image"),
        ([5, START, IMAGE, IMAGE, END], [7], ValueError, "holds 2 image placeholder tokens, its 1 images need 1"),
        ([5, START, IMAGE, END, VIDEO], [7], UnsupportedModelError, "video inputs are not served"),
    ],
)
def test_what_the_vision_path_cannot_compute_is_refused(prompt, response, error, match):
    model = _model("qwen2_5_vl")
    g = torch.Generator().manual_seed(0)
    mm = MultimodalBatch(RolloutBatch.from_lists([prompt], [response]), ((_image(g, 2, 2),),))
    with pytest.raises(error, match=match):
        VisionLanguageActor(model=model)(mm)


def test_unserved_families_are_refused():
    from zorro_core.models.presets import build_model, preset_config

    text_model = build_model(preset_config("tiny-qwen3"))
    with pytest.raises(UnsupportedModelError, match="images with model type 'qwen3' are not served"):
        VisionLanguageActor(model=text_model)(vision_batch())


def test_wrong_positions_or_a_missing_deepstack_fail_by_orders_of_magnitude(monkeypatch):
    """The proof can see the two multimodal specifics: text positions in place of the 3-D mRoPE,
    and Qwen3-VL without its deepstack features."""
    import zorro_core.actor.vision as vision_actor
    from zorro_core.models import vision

    mm = vision_batch()
    model = _model("qwen2_5_vl")
    monkeypatch.setattr(vision_actor, "mrope_positions", lambda plan, *a: plan.position_ids.expand(3, -1))
    _, lp_err, _, g_err, _, _ = _errors(VisionLanguageActor(model=model), mm)
    assert lp_err > 1e-3 and g_err > 1e-3
    monkeypatch.undo()
    model = _model("qwen3_vl")
    monkeypatch.setattr(vision, "VISION_FAMILIES", {"qwen3_vl": vision.VisionFamily("qwen3_vl", deepstack=False)})
    with torch.no_grad():
        lp = VisionLanguageActor(model=model)(mm).log_probs
        ref_lp = vision_per_sequence(model, mm)[0]
    assert (lp - ref_lp).abs().max().item() > 1e-3


@pytest.mark.parametrize("grid", [(1, 4, 4), (1, 8, 12)])
def test_vision_flops_are_the_towers_own_count(family, grid):
    """The cost the benchmark's ideal counts for the vision tower, against torch's FLOP counter
    (eager attention: its matmuls are counted; windowed and full blocks, deepstack mergers)."""
    from torch.utils.flop_counter import FlopCounterMode

    from zorro_core.models.vision import vision_flops

    model = build_vision_model(tiny_config(family), attn_implementation="eager")
    n = grid[0] * grid[1] * grid[2]
    with FlopCounterMode(display=False) as counter:
        model.model.get_image_features(torch.randn(n, 24), torch.tensor([grid]))
    assert vision_flops(model.model.visual, grid) == counter.get_total_flops()


def test_the_benchmarks_padded_arm_is_the_models_own_batch_forward(family):
    """benchmarks/vlm_sharing.py's "hf_padded" arm (what trainers run today) computes the same
    log-probs and entropy as each row alone, so its timing compares like with like."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "vlm_sharing.py"
    spec = importlib.util.spec_from_file_location("vlm_sharing", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = _model(family)
    mm = vision_batch()
    with torch.no_grad():
        lp, ent = bench.padded_forward(model, mm)
        ref_lp, ref_ent, _ = vision_per_sequence(model, mm)
    assert (lp - ref_lp).abs().max().item() < LOGPROB_ATOL
    assert (ent - ref_ent).abs().max().item() < LOGPROB_ATOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_low_precision_stays_within_the_plain_computations_noise(family, dtype):
    """zorro verify's rule for float32/bfloat16: against the float64 per-row reference, dedup's error
    is at most LOW_PRECISION_FACTOR x the plain computation's (same dtype, same path, nothing shared)
    + the float64 floor, for log-probs, entropy and each parameter's gradient."""
    import copy

    from zorro_core.verify.reference import rel_grad_errors
    from zorro_core.verify.tolerances import LOW_PRECISION_FACTOR

    model64 = _model(family)
    mm = vision_batch()
    w = token_weights(mm.batch)
    ref = vision_per_sequence(model64, mm, weights=w)
    low = copy.deepcopy(model64).to(dtype)
    runs = {}
    for name, cls in (("dedup", VisionLanguageActor), ("plain", BaselineVisionLanguageActor)):
        out, lp_err, ent_err, _, _, grads = _errors(cls(model=low), mm, ref)
        runs[name] = (lp_err, ent_err, rel_grad_errors(grads, ref[2]))
    (d_lp, d_ent, d_g), (p_lp, p_ent, p_g) = runs["dedup"], runs["plain"]
    assert d_lp <= LOW_PRECISION_FACTOR * p_lp + LOGPROB_ATOL, (d_lp, p_lp)
    assert d_ent <= LOW_PRECISION_FACTOR * p_ent + LOGPROB_ATOL, (d_ent, p_ent)
    worse = {n: (e, p_g[n]) for n, e in d_g.items() if e > LOW_PRECISION_FACTOR * p_g[n] + GRAD_RTOL}
    assert not worse, worse


def test_micro_batching_an_image_batch_is_refused():
    actor = VisionLanguageActor(model=_model("qwen2_5_vl"))
    with pytest.raises(TypeError, match="not served by forward_backward.*zorro_core.RolloutBatch"):
        actor.forward_backward(vision_batch(), lambda out, rows: out.log_probs.sum())


def _own_positions(model, mm: MultimodalBatch) -> tuple[torch.Tensor, ...]:
    """Each row's positions as a trainer computes them (verl): the model's get_rope_index of the whole row."""
    from zorro_core.models.vision import token_types

    ps, rs = mm.batch.to_lists()
    out = []
    for p, r, imgs in zip(ps, rs, mm.images):
        ids = torch.tensor(p + r)[None]
        grid = torch.tensor([i.grid_thw for i in imgs]) if imgs else None
        pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=token_types(ids, model.config), image_grid_thw=grid)
        out.append(pos[:, 0])
    return tuple(out)


def test_given_positions_are_laid_exactly(family):
    """A trainer's own positions (MultimodalBatch.positions) give the same exact result; rows whose given
    prompt positions differ are different prompts; a wrong position is seen."""
    model = _model(family)
    mm = vision_batch(3)
    given = _own_positions(model, mm)
    out, _ = _assert_exact(VisionLanguageActor(model=model), MultimodalBatch(mm.batch, mm.images, given))
    assert out.plan.group_of_row.tolist() == [0, 0, 1, 2, 0, 2, 3]
    ref = vision_per_sequence(model, mm)[0]
    shifted = list(given)
    shifted[1] = shifted[1] + 1  # row 1's whole row one further: its own prompt now, same result (RoPE is relative)
    out = VisionLanguageActor(model=model)(MultimodalBatch(mm.batch, mm.images, tuple(shifted)))
    assert out.plan.group_of_row.tolist() == [0, 1, 2, 3, 0, 3, 4]
    assert (out.log_probs.detach() - ref).abs().max().item() < LOGPROB_ATOL
    plen = int(mm.batch.prompt_mask[1].sum())
    shifted[1] = given[1] + 5 * (torch.arange(given[1].shape[1]) >= plen).long()  # only its response moved
    out = VisionLanguageActor(model=model)(MultimodalBatch(mm.batch, mm.images, tuple(shifted)))
    assert out.plan.group_of_row.tolist() == [0, 0, 1, 2, 0, 2, 3]
    # a tiny model moves little with positions: 100x the tolerance is what a wrong position must show
    assert (out.log_probs.detach() - ref)[1].abs().max().item() > 100 * LOGPROB_ATOL
    assert (out.log_probs.detach() - ref)[0].abs().max().item() < LOGPROB_ATOL
    with pytest.raises(ValueError, match=r"positions of row 0 must be an integer \[3, "):
        MultimodalBatch(mm.batch, mm.images, (given[0][:, :-1],) + given[1:])


# ---------------------------------------------------------------- sharing="prefix" with images


def prefix_batch(seed: int = 0) -> MultimodalBatch:
    """zorro verify's prefix batch (zorro_core.verify.vision.vision_prefix_batch): rows {0, 1, 6, 8}
    share [t1, a, 8] (6 holds a as another tensor, 8's prompt ends there and its response runs on as
    0's prompt does); 2 is 0's tokens with another image b of the same grid (they diverge at the
    image); 3 and 4 share a whole prompt of two images (a recurring from the first rows, then c); 5
    shares [t2, a] with them and diverges where c starts; 7 is text only. a, b and c are the call's
    three distinct images."""
    from zorro_core.verify.vision import vision_prefix_batch

    return vision_prefix_batch(tiny_config("qwen2_5_vl"), seed)


def _prefix_actor(model, **options):
    return VisionLanguageActor(model=model, sharing="prefix", min_shared_tokens=options.pop("min_shared", 1), **options)


@pytest.mark.parametrize("split,attn,backend", MODES)
def test_prefix_sharing_with_images_equals_each_row_alone(family, split, attn, backend):
    model = _model(family, attn)
    actor = _prefix_actor(model, use_split_attention=split, varlen_backend=backend)
    mm = prefix_batch()
    out, grads = _assert_exact(actor, mm)
    plan = out.plan
    assert plan.sharing == "prefix"
    assert any(n.startswith("model.visual.") for n in grads), "the vision tower got no gradient"
    # What is shared: [t1, a, 8] once for rows 0, 1, 6 and 8 (17 tokens), 0's and 6's whole prompt
    # and first two response tokens once; b's row apart from its first three tokens.
    assert plan.num_tokens < mm.batch.prompt_mask.sum() + mm.batch.response_mask.sum()
    prompt_plan = VisionLanguageActor(model=model)(mm).plan
    assert plan.num_tokens < prompt_plan.num_tokens


def test_prefix_sharing_splits_at_a_different_image_and_keys_images_by_content():
    """The trie's nodes: rows 0 and 2 (same tokens, images a and b) share only the text before the
    image; rows 0 and 6 (a as two tensors) share their whole prompt."""
    from zorro_core.plan.multimodal import image_slots, image_trie_plan, trie_row_index

    mm = prefix_batch()
    distinct, ids = distinct_images(mm.images)
    assert len(distinct) == 3 and ids[0] == ids[6] == ids[8] == [0] and ids[2] == [1]
    slots = image_slots(mm.batch, ids, [4, 4, 2], IMAGE)
    plan, token_slot = image_trie_plan(mm.batch, slots, IMAGE, 256, 1)
    rows = trie_row_index(plan)

    def common(i: int, j: int) -> int:  # packed tokens two rows' paths share (a common prefix)
        n = min(len(rows[i]), len(rows[j]))
        same = (rows[i][:n] == rows[j][:n]).tolist() + [False]
        return same.index(False)

    assert common(0, 2) == 4  # t1 and the vision start token, then a's tokens vs b's
    assert common(0, 6) == 12 + 2  # the whole prompt (t1, a in 6 tokens, 8, 30, 31) and responses' [11, 12]
    assert common(0, 8) == 12 + 0  # 8's prompt (10 tokens) and its response's [30, 31] are 0's prompt
    assert common(3, 5) == 2 + 6  # t2 and a (start, 4 tokens, end), then c's start vs text 3
    assert plan.input_ids.max() < 256 and bool((plan.input_ids[token_slot >= 0] == IMAGE).all())
    # a's 4 tokens once under t1 (rows 0, 1, 6, 8) and once under t2 (rows 3, 4, 5); b's and c's once.
    assert torch.bincount(token_slot[token_slot >= 0]).tolist() == [2] * 4 + [1] * 4 + [1] * 2


def test_prefix_sharing_with_checkpointing_and_a_frozen_tower(family):
    model = _model(family)
    enable_checkpointing(model, "non-reentrant")
    model.train()
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    _, grads = _assert_exact(_prefix_actor(model), prefix_batch(2))
    assert not any(n.startswith("model.visual.") for n in grads)


def test_prefix_sharing_at_the_default_min_shared_tokens(family):
    """Runs shorter than 16 tokens are folded into their children: still exact, images still shared."""
    _assert_exact(_prefix_actor(_model(family), min_shared=16), prefix_batch(3))


def test_prefix_sharing_runs_the_vision_tower_once_per_distinct_image(family):
    model = _model(family)
    seen = []
    model.model.visual.register_forward_hook(
        lambda m, args, kwargs, out: seen.append(kwargs["grid_thw"].shape[0]), with_kwargs=True
    )
    _prefix_actor(model)(prefix_batch())
    assert seen == [3]


def test_rows_that_number_a_shared_token_differently_are_refused():
    from zorro_core.plan.multimodal import image_slots, image_trie_plan, trie_mrope_positions, trie_row_index

    mm = prefix_batch()
    distinct, ids = distinct_images(mm.images)
    plan, _ = image_trie_plan(mm.batch, image_slots(mm.batch, ids, [4, 4, 2], IMAGE), IMAGE, 256, 1)
    lens = [len(r) for r in trie_row_index(plan)]
    good = [torch.arange(n).expand(3, n) for n in lens]
    assert torch.equal(trie_mrope_positions(plan, good)[0], plan.position_ids)
    bad = [p.clone() for p in good]
    bad[1][2, 0] += 1  # row 1 numbers its (shared) first token differently
    with pytest.raises(RuntimeError, match="different 3-D positions"):
        trie_mrope_positions(plan, bad)


def test_prefix_sharing_with_text_positions_fails(monkeypatch):
    """The planted bug: the trie row's 1-D path positions in place of the model's 3-D ones."""
    import zorro_core.actor.vision as vision_actor

    monkeypatch.setattr(vision_actor, "trie_mrope_positions", lambda plan, *a: plan.position_ids.expand(3, -1))
    _, lp_err, _, g_err, _, _ = _errors(_prefix_actor(_model("qwen3_vl")), prefix_batch())
    assert lp_err > 1e-3 and g_err > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_prefix_sharing_low_precision_stays_within_the_plain_computations_noise(dtype):
    import copy

    from zorro_core.verify.reference import rel_grad_errors
    from zorro_core.verify.tolerances import LOW_PRECISION_FACTOR

    model64 = _model("qwen2_5_vl")
    mm = prefix_batch()
    w = token_weights(mm.batch)
    ref = vision_per_sequence(model64, mm, weights=w)
    low = copy.deepcopy(model64).to(dtype)
    runs = {}
    for name, actor in (("dedup", _prefix_actor(low)), ("plain", BaselineVisionLanguageActor(model=low))):
        _, lp_err, ent_err, _, _, grads = _errors(actor, mm, ref)
        runs[name] = (lp_err, ent_err, rel_grad_errors(grads, ref[2]))
    (d_lp, d_ent, d_g), (p_lp, p_ent, p_g) = runs["dedup"], runs["plain"]
    assert d_lp <= LOW_PRECISION_FACTOR * p_lp + LOGPROB_ATOL, (d_lp, p_lp)
    assert d_ent <= LOW_PRECISION_FACTOR * p_ent + LOGPROB_ATOL, (d_ent, p_ent)
    worse = {n: (e, p_g[n]) for n, e in d_g.items() if e > LOW_PRECISION_FACTOR * p_g[n] + GRAD_RTOL}
    assert not worse, worse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_the_device_fingerprint_buckets_by_every_bit(dtype):
    """The key a GPU's images are bucketed by (computed on their device, no pixel copied to the host):
    equal for equal pixels, changed by one value's last bit or by two values swapped."""
    from zorro_core.plan.multimodal import _fingerprint

    x = torch.randn(64, 24, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(_fingerprint(x), _fingerprint(x.clone()))
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[dtype]
    flipped = x.clone()
    flipped.view(-1).view(bits)[7] ^= 1
    swapped = x.clone()
    swapped[0, 0], swapped[0, 1] = x[0, 1], x[0, 0]
    assert not torch.equal(_fingerprint(x), _fingerprint(flipped))
    assert not torch.equal(_fingerprint(x), _fingerprint(swapped))
