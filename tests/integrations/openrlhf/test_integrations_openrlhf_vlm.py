"""zorro's DedupActor on OpenRLHF's vision-language calls (issue 48), against OpenRLHF's own Actor.forward.

Runs in OpenRLHF's venv (.ci/openrlhf_tests); skipped elsewhere. Tiny random Qwen2.5-VL and Qwen3-VL
saved and loaded by OpenRLHF's own constructor (by path: `is_vlm`, `AutoModelForImageTextToText`), cast
to float64. The micro-batch is OpenRLHF's padded Experience batch (`make_experience_batch`) with
`mm_inputs` as `merge_mm_train_inputs` gives them (each sample's `pixel_values` and `image_grid_thw`
concatenated in row order). Groups: one image (3 rows), the same text with another image (1 row), two
images with the first recurring (2 rows). Log-probs, entropy and every gradient (the vision tower's
included) are compared; swapping two rows' images (a planted bug) must fail.
"""

import warnings

import pytest
import torch
from openrlhf_setup import OPENRLHF_MISSING, make_actor, right_padded

from zorro_core.verify.reference import max_rel_grad_error

pytestmark = pytest.mark.skipif(OPENRLHF_MISSING is not None, reason=OPENRLHF_MISSING or "")

if OPENRLHF_MISSING is None:
    from openrlhf.models import Actor

    from zorro_core.integrations.layout import DedupFallbackWarning
    from zorro_core.integrations.openrlhf import actor as zo
    from zorro_core.plan.multimodal import Image

LP_ATOL = 1e-6  # OpenRLHF computes log-probs and entropy from float32 logits, even for a float64 model
GRAD_RTOL = 1e-5
TEMPERATURE = 0.7
FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
IMAGE, VIDEO, START, END = 250, 251, 252, 253


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    from zorro_core.models.vision import build_vision_model, tiny_config

    path = str(tmp_path_factory.mktemp("openrlhf_vlm") / request.param)
    build_vision_model(tiny_config(request.param), dtype=torch.float32).save_pretrained(path)
    return path


def _placeholders(grid, token=IMAGE):
    return [START] + [token] * (int(grid.prod()) // 4) + [END]


def vlm_samples(seed: int = 0):
    """(prompt, response) token tensors and each row's images ((pixel_values, grid) pairs)."""
    g = torch.Generator().manual_seed(seed)

    def image(h, w):
        return torch.randn(h * w, 24, generator=g), torch.tensor([1, h, w])

    a, b, c = image(4, 4), image(4, 6), image(2, 4)
    t1, t2 = [5, 6, 7], [9, 10]
    prompts = [
        (t1 + _placeholders(a[1]) + [8], [a]),
        (t1 + _placeholders(b[1]) + [8], [b]),
        (t2 + _placeholders(a[1]) + _placeholders(c[1]) + [3], [a, c]),
    ]
    rows = []
    for u, n in ((0, 3), (1, 1), (2, 2)):
        for _ in range(n):
            r = torch.randint(11, 240, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
            rows.append((torch.tensor(prompts[u][0]), r, prompts[u][1]))
    return rows


def mm_inputs_of(images_per_row):
    """`merge_mm_train_inputs` of one dict per sample, as OpenRLHF's experience keeps them."""
    from openrlhf.utils.vlm_utils import merge_mm_train_inputs

    per_sample = [
        {
            "pixel_values": torch.cat([im[0] for im in ims]).double(),
            "image_grid_thw": torch.stack([im[1] for im in ims]),
        }
        for ims in images_per_row
    ]
    return merge_mm_train_inputs([per_sample], torch.device("cpu"))


def run(actor, seq, att, act, mm, seed: int = 1):
    actor.model.zero_grad(set_to_none=True)
    lp, out = actor(seq, act, att, return_output=True, return_entropy=True, **mm)
    ent = out.entropy[:, -act.shape[1] :] * act
    g = torch.Generator().manual_seed(seed)
    loss = (lp * torch.randn(lp.shape, generator=g)).sum() + (ent * torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def _batch(rows):
    seq, att, act = right_padded([(p, r) for p, r, _ in rows])
    return seq, att, act, mm_inputs_of([ims for _, _, ims in rows])


def test_images_served_equal_openrlhf_actor(ckpt):
    rows = vlm_samples()
    seq, att, act, mm = _batch(rows)
    ref = make_actor(Actor, ckpt, attn="sdpa", temperature=TEMPERATURE)
    ded = make_actor(zo.DedupActor, ckpt, attn="sdpa", temperature=TEMPERATURE)
    assert ref.is_vlm and ded.is_vlm
    patches = []
    ded.model.model.visual.register_forward_hook(lambda m, args, out: patches.append(int(args[0].shape[0])))
    ref_lp, ref_ent, ref_grads = run(ref, seq, att, act, mm)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DedupFallbackWarning)
        lp, ent, grads = run(ded, seq, att, act, mm)
    assert ded.zorro_calls.get("dedup", 0) == 1 and ded.zorro_calls.get("fallback", 0) == 0, ded.zorro_calls
    m = act.bool()
    assert float((lp - ref_lp)[m].abs().max()) <= LP_ATOL
    assert float((ent - ref_ent)[m].abs().max()) <= LP_ATOL
    assert sorted(grads) == sorted(ref_grads) and any(".visual." in n for n in grads)
    err, name = max_rel_grad_error(grads, ref_grads)
    assert err <= GRAD_RTOL, (name, err)
    # each distinct image once: a (16 patches), b (24), c (8), not the rows' 3*16 + 24 + 2*(16 + 8)
    assert patches == [16 + 24 + 8], patches


def test_swapped_images_fail(ckpt):
    """A planted bug: row 0 gets another image of the same grid (its pixels negated)."""
    rows = vlm_samples()
    seq, att, act, mm = _batch(rows)
    ref = make_actor(Actor, ckpt, attn="sdpa", temperature=TEMPERATURE)
    ded = make_actor(zo.DedupActor, ckpt, attn="sdpa", temperature=TEMPERATURE)
    ref_lp, _, ref_grads = run(ref, seq, att, act, mm)
    original = zo.row_images

    def swapped(*args):
        out = original(*args)
        out[0] = tuple(Image(-im.pixel_values, im.grid_thw) for im in out[0])
        return out

    zo.row_images = swapped
    try:
        lp, _, grads = run(ded, seq, att, act, mm)
    finally:
        zo.row_images = original
    assert float((lp - ref_lp)[act.bool()].abs().max()) > 1e-3 and max_rel_grad_error(grads, ref_grads)[0] > 1e-3


def test_a_video_is_not_served(ckpt):
    rows = vlm_samples()[:2]
    seq, att, act, mm = _batch(rows)
    mm = dict(
        mm, pixel_values_videos=torch.zeros(32, 24, dtype=torch.float64), video_grid_thw=torch.tensor([[2, 4, 4]])
    )
    ded = make_actor(zo.DedupActor, ckpt, attn="sdpa", temperature=TEMPERATURE)
    reason = ded._refusal(act, att, None, mm)[0]
    assert reason is not None and "video" in reason, reason


def test_images_that_do_not_match_the_placeholders_fall_back(ckpt):
    rows = vlm_samples()
    seq, att, act, mm = _batch(rows)
    mm = dict(mm, pixel_values=mm["pixel_values"][:-8], image_grid_thw=mm["image_grid_thw"][:-1])
    ref = make_actor(Actor, ckpt, attn="sdpa", temperature=TEMPERATURE)
    ded = make_actor(zo.DedupActor, ckpt, attn="sdpa", temperature=TEMPERATURE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ded(seq, act, att, **mm)
        except Exception:
            pass  # OpenRLHF's own forward refuses the mismatch too
        try:
            ref(seq, act, att, **mm)
        except Exception:
            pass
    notes = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
    assert len(notes) == 1 and "placeholders" in notes[0], notes
