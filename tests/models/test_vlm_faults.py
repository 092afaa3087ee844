"""Faults of the vision path (issue 60): grids bounded and typed before anything is sized by them, each run
of an image's placeholders checked against its image, a NaN pixel kept to its own rows, and what
forward_backward does not serve named."""

import pytest
import torch
from test_vlm import END, IMAGE, START, _image, _model, _placeholders

from zorro_core.actor.vision import VisionLanguageActor
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.multimodal import MAX_IMAGE_PATCHES, Image, MultimodalBatch


@pytest.mark.parametrize("grid", [(1, 2**20, 2**20), (1, 2**31, 2), (2**40, 2**40, 2**40)])
def test_a_grid_past_the_bound_is_refused_before_anything_is_sized_by_it(grid):
    """Defect 3: the grid is checked before its product sizes a split or a placeholder count."""
    batch = RolloutBatch.from_lists([[1, IMAGE]], [[3]])
    with pytest.raises(ValueError, match=f"holds .* patches, over the {MAX_IMAGE_PATCHES:,}"):
        MultimodalBatch.from_processor(batch, torch.zeros(4, 24), torch.tensor([grid]), [1])
    with pytest.raises(ValueError, match=f"over the {MAX_IMAGE_PATCHES:,}"):
        Image(torch.zeros(4, 24), grid)


@pytest.mark.parametrize(
    "grid,per_row",
    [
        ((1.5, 2, 2), [1]),  # 1.5 frames
        ((True, 2, 2), [1]),
        ((1, 2, 2), [1.0]),
        ((1, 2, 2), [True]),
    ],
)
def test_float_or_bool_grids_and_counts_are_refused(grid, per_row):
    """Defect 7: floats and bools were taken silently as ints."""
    batch = RolloutBatch.from_lists([[1, IMAGE]], [[3]])
    with pytest.raises(ValueError, match="grid_thw must be three positive ints|images_per_row must hold ints"):
        MultimodalBatch.from_processor(batch, torch.zeros(4, 24, dtype=torch.float64), [list(grid)], per_row)
    with pytest.raises(ValueError, match="must hold ints|must be three positive ints"):
        MultimodalBatch.from_processor(batch, torch.zeros(4, 24), torch.tensor([grid], dtype=torch.float64), per_row)
    if type(per_row[0]) is int:
        with pytest.raises(ValueError, match="grid_thw must be three positive ints"):
            Image(torch.zeros(4, 24), grid)


def test_numpy_and_tensor_ints_are_taken():
    import numpy as np

    img = Image(torch.zeros(4, 24), (np.int64(1), np.int32(2), torch.tensor(2).item()))
    assert img.grid_thw == (1, 2, 2) and all(type(x) is int for x in img.grid_thw)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize(
    "prompt_of,match",
    [
        # one image's 4 placeholders split in two runs (the total matches): a bare StopIteration before
        (lambda a, b: [5, START, IMAGE, IMAGE, END, 6, START, IMAGE, IMAGE, END, 7], r"runs of \[2, 2\]"),
        # images needing 4 then 8, runs of 8 then 4: computed mispositioned before
        (lambda a, b: [5] + _placeholders(b) + _placeholders(a) + [7], r"runs of \[8, 4\] .* \[4, 8\]"),
    ],
)
def test_each_run_of_placeholders_must_be_its_images(family, prompt_of, match):
    """Defect 5: each run of placeholders equals its image's t*h*w/merge^2, else a clear error."""
    g = torch.Generator().manual_seed(0)
    a, b = _image(g, 4, 4), _image(g, 4, 8)  # 4 and 8 tokens
    prompt = prompt_of(a, b)
    images = (a,) if prompt.count(IMAGE) == 4 else (a, b)
    mm = MultimodalBatch(RolloutBatch.from_lists([prompt], [[9, 10]]), (images,))
    actor = VisionLanguageActor(model=_model(family))
    with pytest.raises(ValueError, match=match):  # a ValueError, not a StopIteration that ends a map()
        actor(mm)


def test_forward_backward_says_images_are_not_served_there():
    actor = VisionLanguageActor(model=_model("qwen2_5_vl"))
    g = torch.Generator().manual_seed(0)
    a = _image(g, 4, 4)
    mm = MultimodalBatch(RolloutBatch.from_lists([[5] + _placeholders(a)], [[9]]), ((a,),))
    with pytest.raises(TypeError, match="images .*not served by forward_backward"):
        actor.forward_backward(mm, lambda out, rows: out.log_probs.sum())
