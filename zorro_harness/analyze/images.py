"""Images in a dataset for `zorro analyze --data`: each prompt's image tokens, counted from the grid.

A Qwen-VL processor turns an image into a patch grid (t, h, w) and the prompt's one image placeholder
token into t*h*w / merge² placeholder tokens (merge: the vision tower's spatial merge, 2 for
Qwen2.5-VL / Qwen3-VL). The data gives the grids (`image_grid_thw`: per row, one [t, h, w] per image,
as the processor gives them); each prompt's placeholders (`image_token_id`) are matched to its images
in order: one placeholder per image (expanded here to the image's tokens) or already expanded (as a
processor's input_ids hold them). No pixel is read.

What is shared: image tokens are keyed by the image they hold, so two prompts share a run of tokens
only while they hold the same image there, as zorro compares images (by content). Which images are
the same: the `images` column when the data has one (per row, one entry per image: a string such as
a path or URL, or datasets' {"bytes", "path"}; equal bytes or, without bytes, equal strings are one
image; nothing is opened), else each data row's images are its own (an image recurring in two data
rows is then not counted as shared: a lower bound). The responses of one prompt (a group) always share
its images.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from zorro_core.plan.multimodal import MAX_IMAGE_PATCHES
from zorro_harness.analyze.ragged import Ragged
from zorro_harness.analyze.readers import DatasetError

IMAGE_GRID_COLUMNS = ("image_grid_thw",)
IMAGE_COLUMNS = ("images", "image")
IMAGE_TOKEN = "<|image_pad|>"
"""The Qwen-VL image placeholder token, looked up in the tokenizer when no --image-token-id is given."""
SPATIAL_MERGE = 2
"""Qwen2.5-VL's and Qwen3-VL's spatial merge (2x2 patches per token)."""
MAX_ROW_IMAGE_TOKENS = 2**24
"""The most image tokens one data row's images may hold (each image is bounded by MAX_IMAGE_PATCHES)."""
MAX_DATA_IMAGE_TOKENS = 2**28
"""The most image tokens the rows of one analysis may hold (2 GiB of int64 token ids), checked row by row
before a row's tokens are made."""


@dataclass
class DataImages:
    """The images of a dataset's prompts, per data row."""

    count: np.ndarray
    """[rows] images of each row's prompt."""
    tokens: np.ndarray
    """[rows] image tokens of each row's prompt (sum of t*h*w / merge² over its images)."""
    keys: Ragged
    """Per row, the distinct-image number of each of its images (equal numbers: one image)."""
    identity: str
    """How images were told apart: "content" (the images column) or "row" (each data row's own)."""
    image_token_id: int
    """The placeholder token matched to the images."""


def _grid(path: str, column: str, row: int, g: Any, merge: int) -> int:
    ints = isinstance(g, (list, tuple)) and len(g) == 3
    if not (ints and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in g)):
        raise DatasetError(f"{path}: row {row} of column {column!r}: an image grid is three positive ints, got {g!r}")
    t, h, w = g
    if t * h * w > MAX_IMAGE_PATCHES:  # python ints: checked before anything is sized by it
        raise DatasetError(
            f"{path}: row {row} of column {column!r}: grid {list(g)} holds {t * h * w:,} patches, over the "
            f"{MAX_IMAGE_PATCHES:,} zorro takes for one image"
        )
    if h % merge or w % merge:
        raise DatasetError(f"{path}: row {row} of column {column!r}: grid {list(g)} is not divisible by merge {merge}")
    return t * h * w // (merge * merge)


def _identity(path: str, column: str, row: int, image: Any) -> str:
    """A key of an image's content: its bytes' digest, else its path or string."""
    if isinstance(image, str):
        return "s:" + image
    if isinstance(image, dict):
        data = image.get("bytes")
        if isinstance(data, (bytes, bytearray)):
            return "b:" + hashlib.sha256(data).hexdigest()
        if isinstance(image.get("path"), str):
            return "s:" + image["path"]
    raise DatasetError(
        f"{path}: row {row} of column {column!r}: an image is a string (path or URL) or {{'bytes', 'path'}}, "
        f"got {type(image).__name__}"
    )


def expand_images(
    path: str,
    prompts: Ragged,
    grid_column: str,
    grids: list,
    image_column: Optional[str],
    images: Optional[list],
    image_token_id: int,
    key_base: int,
    merge: int = SPATIAL_MERGE,
) -> tuple[Ragged, DataImages]:
    """The prompts with each image's placeholders as its own tokens (ids `key_base` + the image's
    slot, so equal only where the image is the same), and the images per row (see the module doc)."""
    if len(grids) != len(prompts) or (images is not None and len(images) != len(prompts)):
        raise DatasetError(f"{path}: the image columns and the prompts have different numbers of rows")
    slot: dict[str, tuple[int, int]] = {}  # image key -> (first token id, tokens)
    next_id = key_base
    rows: list[np.ndarray] = []
    keys: list[list[int]] = []
    count, tokens = np.zeros(len(prompts), np.int64), np.zeros(len(prompts), np.int64)
    fresh = 0
    for r in range(len(prompts)):
        ids = prompts.row(r)
        row_grids = grids[r] or []
        if not isinstance(row_grids, (list, tuple)):
            raise DatasetError(f"{path}: row {r} of column {grid_column!r} is not a list of [t, h, w] grids")
        sizes = [_grid(path, grid_column, r, list(g) if isinstance(g, tuple) else g, merge) for g in row_grids]
        if sum(sizes) > MAX_ROW_IMAGE_TOKENS:
            raise DatasetError(
                f"{path}: row {r}: its {len(sizes)} images hold {sum(sizes):,} image tokens, over the "
                f"{MAX_ROW_IMAGE_TOKENS:,} zorro takes in one row"
            )
        fresh += sum(sizes)  # an upper bound on the new keyed tokens (images seen before add none)
        if fresh > MAX_DATA_IMAGE_TOKENS:
            raise DatasetError(
                f"{path}: row {r}: the data's images reach {fresh:,} image tokens, over the "
                f"{MAX_DATA_IMAGE_TOKENS:,} zorro takes in one analysis"
            )
        row_images = (images[r] or []) if images is not None else None
        if row_images is not None and len(row_images) != len(sizes):
            raise DatasetError(
                f"{path}: row {r} has {len(row_images)} images in {image_column!r} and {len(sizes)} grids"
            )
        at = np.flatnonzero(ids == image_token_id)
        if not sizes:
            if at.size:
                raise DatasetError(f"{path}: row {r}'s prompt holds image placeholders but the row has no image grid")
            rows.append(ids)
            keys.append([])
            continue
        row_keys, runs = [], []
        for k, n in enumerate(sizes):
            key = _identity(path, image_column or "", r, row_images[k]) if row_images is not None else f"r:{r}:{k}"
            if key not in slot:
                slot[key] = (next_id, n)
                next_id += n
            first, n_seen = slot[key]
            if n_seen != n:
                raise DatasetError(f"{path}: row {r}: one image has grids of {n_seen} and {n} tokens in two rows")
            row_keys.append(first)
            runs.append(np.arange(first, first + n, dtype=np.int64))
        if at.size == len(sizes):  # one placeholder an image: expanded
            pieces, prev = [], 0
            for p, run in zip(at.tolist(), runs):
                pieces += [ids[prev:p], run]
                prev = p + 1
            rows.append(np.concatenate(pieces + [ids[prev:]]))
        elif at.size == sum(sizes):  # already expanded: each run keyed by its image
            out = ids.copy()
            out[at] = np.concatenate(runs)
            rows.append(out)
        else:
            raise DatasetError(
                f"{path}: row {r}'s prompt holds {at.size} image placeholder tokens (id {image_token_id}); its "
                f"{len(sizes)} images need one each or {sum(sizes)} in all"
            )
        count[r], tokens[r] = len(sizes), sum(sizes)
        keys.append(row_keys)
    images_of = DataImages(
        count, tokens, Ragged.from_lists(keys), "content" if images is not None else "row", image_token_id
    )
    return Ragged.from_lists(rows), images_of


def image_counts(images: DataImages, call: np.ndarray, prompt: np.ndarray, rank: np.ndarray) -> dict:
    """Image tokens and vision-tower images over the simulated rows (`call[i]`, `prompt[i]`: row i's
    call and data row; `rank`: each data row's distinct-prompt number): every row in full, and with
    sharing="prompt" (each distinct prompt of a call once; each distinct image of a call encoded once)."""
    per_call = int(rank.max()) + 1 if rank.size else 1
    _, first = np.unique(call * per_call + rank[prompt], return_index=True)
    lens = images.keys.lens[prompt]
    starts = images.keys.offsets[prompt]
    flat = images.keys.flat[np.repeat(starts - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))]
    key_call = np.repeat(call, lens)
    span = int(flat.max()) + 1 if flat.size else 1
    return {
        "image_tokens": {
            "baseline": int(images.tokens[prompt].sum()),
            "prompt": int(images.tokens[prompt[first]].sum()),
        },
        "vision_tower_images": {
            "baseline": int(lens.sum()),
            "dedup": int(np.unique(key_call * span + flat).size) if flat.size else 0,
        },
    }
