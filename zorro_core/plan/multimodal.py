"""Vision-language rollouts: a RolloutBatch plus each row's images, grouped by the whole prompt.

A row's prompt is its text tokens and its images. Two rows share a group only when both are the
same: the same real prompt tokens (as `prompt_groups` compares them) and the same images in the
same order, images compared by content (dtype, shape, grid and every pixel value's bytes; a
key buckets them, `torch.equal` decides), never by object identity. So two rows with the same
text and different images are two prompts, and one image tensor passed twice is one image. The
keys are computed where the pixels are (on a GPU a fingerprint of their bits: no pixel is copied
to the host) and `torch.equal` decides on that device.

The distinct images of a call are numbered once over the whole batch, so an image that recurs in
several prompts (several groups) is encoded by the vision tower once. `mrope_positions` lays the
model's own 3-D rotary positions of each unique prompt into the packed row and continues each
response from its prompt, as the model numbers a whole [prompt + response] row. A trainer that
computed every row's positions itself (verl) gives them with the batch (`MultimodalBatch.positions`):
`given_positions` lays exactly those, and rows whose prompt positions differ are different prompts.

`sharing="prefix"` (`image_trie_plan`): the token trie is built over rows whose image placeholders
are keyed by the image they hold. Each placeholder token gets its *slot* (its row in the distinct
images' embeddings, concatenated: image i's k-th token is `offset_i + k`), and the trie compares a
placeholder by `vocab + slot`, so rows share a run only while their text tokens and their images
(by content) are the same, and a different image in otherwise equal tokens is where they diverge.
Every row's 3-D positions are the model's own numbering of that row; they are laid into the packed
row through each row's path (`trie_mrope_positions`), which checks that rows sharing a token gave it
the same position (the model numbers a row causally, so they must; this is asserted, not assumed).
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.prompt import PromptPlan, prompt_groups
from zorro_core.plan.trie import TriePlan, build_trie_plan

MAX_IMAGE_PATCHES = 2**20
"""The most patches (t*h*w) one image's grid may hold: 16 times what the Qwen2.5-VL and Qwen3-VL
processors give at their default largest size (65,536 patches); a grid past it is refused before
anything is sized by it (the vision actor's checks, `zorro analyze --data`)."""


def check_grid(grid: object) -> tuple[int, int, int]:
    """An image's (t, h, w) patch grid as three ints, refused (ValueError naming the grid) unless each is
    a positive integer (not a bool or a float: 1.5 frames is no grid) and t*h*w <= MAX_IMAGE_PATCHES."""
    values: Any = grid.tolist() if isinstance(grid, torch.Tensor) else grid
    ok = isinstance(values, (list, tuple)) and len(values) == 3
    ok = ok and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= 1 for x in values)
    if not ok:
        raise ValueError(f"an image's grid_thw must be three positive ints (t, h, w), got {values!r}")
    t, h, w = (int(x) for x in values)
    if t * h * w > MAX_IMAGE_PATCHES:
        raise ValueError(
            f"an image's grid_thw {[t, h, w]} holds {t * h * w:,} patches, over the {MAX_IMAGE_PATCHES:,} zorro "
            "takes for one image (zorro_core.plan.multimodal.MAX_IMAGE_PATCHES)"
        )
    return (t, h, w)


@dataclass(frozen=True)
class Image:
    """One image as a Qwen-VL processor gives it: its patches and its grid."""

    pixel_values: torch.Tensor
    """[t*h*w, C*temporal_patch*patch*patch] the flattened patches, floating point."""
    grid_thw: tuple[int, int, int]
    """(t, h, w): the patch grid (temporal, height, width) before the spatial merge."""

    def __post_init__(self) -> None:
        pv, grid = self.pixel_values, self.grid_thw
        if not isinstance(pv, torch.Tensor) or pv.dim() != 2 or not pv.is_floating_point():
            raise ValueError(
                "an image's pixel_values must be a 2-D floating-point tensor [patches, patch_dim], got "
                + (f"{pv.dtype} of shape {tuple(pv.shape)}" if isinstance(pv, torch.Tensor) else type(pv).__name__)
            )
        grid = check_grid(grid)
        if grid[0] * grid[1] * grid[2] != pv.shape[0]:
            raise ValueError(f"grid_thw {grid} holds {grid[0] * grid[1] * grid[2]} patches, pixel_values {pv.shape[0]}")
        object.__setattr__(self, "grid_thw", grid)

    def content_key(self) -> tuple:
        """A key of the image's content that buckets it (dtype, shape, grid and a fingerprint of every
        pixel value's bits, computed where the pixels are); `same_content` decides."""
        return content_keys([self])[0]

    def same_content(self, other: "Image") -> bool:
        """Exactly the same image (what the key only buckets): every pixel value's bits compared, on
        this image's device."""
        a, b = self.pixel_values.detach(), other.pixel_values.detach()
        return (
            self.grid_thw == other.grid_thw
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b.to(a.device))
        )


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(pixels: torch.Tensor) -> torch.Tensor:
    """[2] int64 on the pixels' device: the sum of the pixel values' bit patterns, plain and weighted
    by position (wrapping in int64, which is exact and order-free on every device). It only buckets
    images (equal images have equal fingerprints; `Image.same_content` decides), so no pixel is
    copied to the host for it."""
    flat = pixels.detach().contiguous().view(-1)
    words = flat.view(_WORDS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64) % 65521 + 1
    return torch.stack([words.sum(), (words * weights).sum()])


def content_keys(images: Sequence[Image]) -> list[tuple]:
    """The content key of each image (see `Image.content_key`). Pixels on the host: a SHA-256 of their
    bytes (no copy needed). Elsewhere (a GPU): fingerprints computed on the device and brought to the
    host together, one small copy a device, instead of every image's pixels."""
    values: list = [None] * len(images)
    on_device: dict[torch.device, list[int]] = {}
    for i, img in enumerate(images):
        pv = img.pixel_values.detach()
        if pv.device.type == "cpu":
            values[i] = hashlib.sha256(pv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).digest()
        else:
            on_device.setdefault(pv.device, []).append(i)
    for idx in on_device.values():
        prints = torch.stack([_fingerprint(images[i].pixel_values) for i in idx]).tolist()
        for i, v in zip(idx, prints):
            values[i] = tuple(v)
    return [
        (str(img.pixel_values.dtype), tuple(img.pixel_values.shape), img.grid_thw, v) for img, v in zip(images, values)
    ]


@dataclass(frozen=True)
class MultimodalBatch:
    """A RolloutBatch whose prompts hold images: `images[i]` are row i's, in the order of their
    placeholders in its prompt (a row without images has an empty tuple)."""

    batch: RolloutBatch
    """The token rows, as for text (each image's placeholder tokens are in the prompt)."""
    images: tuple[tuple[Image, ...], ...]
    """Per row, its images in prompt order."""
    positions: Optional[tuple[torch.Tensor, ...]] = None
    """Per row, the [3, prompt_len + response_len] rotary positions of its real tokens (prompt, then
    response) as the trainer computed them (verl's position ids); None: the actor asks the model's
    own get_rope_index."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch, RolloutBatch):
            raise TypeError(f"MultimodalBatch.batch must be a RolloutBatch, got {type(self.batch).__name__}")
        rows = tuple(tuple(r) for r in self.images)
        if len(rows) != self.batch.batch_size:
            raise ValueError(f"images are given for {len(rows)} rows, the batch has {self.batch.batch_size}")
        for i, row in enumerate(rows):
            for img in row:
                if not isinstance(img, Image):
                    raise TypeError(
                        f"images of row {i} must be zorro_core.plan.multimodal.Image, got {type(img).__name__}"
                    )
        object.__setattr__(self, "images", rows)
        if self.positions is not None:
            object.__setattr__(self, "positions", _checked_positions(self.batch, self.positions))

    @classmethod
    def from_processor(
        cls,
        batch: RolloutBatch,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor,
        images_per_row: Sequence[int],
    ) -> "MultimodalBatch":
        """From a processor's batch layout: every image's patches concatenated ([sum patches, D]),
        one grid row per image ([n, 3]), row i holding the next `images_per_row[i]` images."""
        if isinstance(image_grid_thw, torch.Tensor) and (
            image_grid_thw.is_floating_point() or image_grid_thw.dtype == torch.bool
        ):
            raise ValueError(f"image_grid_thw must hold ints, got a {image_grid_thw.dtype} tensor")
        if not isinstance(image_grid_thw, torch.Tensor):  # a list: each grid checked as given (1.5 is no int)
            for g in image_grid_thw:
                check_grid(g)
        grids = torch.as_tensor(image_grid_thw)
        if grids.dim() != 2 or grids.shape[1] != 3:
            raise ValueError(f"image_grid_thw must be [images, 3], got shape {tuple(grids.shape)}")
        counts = list(images_per_row.tolist() if isinstance(images_per_row, torch.Tensor) else images_per_row)
        if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in counts):
            raise ValueError(f"images_per_row must hold ints (images per row), got {counts!r}")
        counts = [int(n) for n in counts]
        if any(n < 0 for n in counts) or sum(counts) != grids.shape[0]:
            raise ValueError(
                f"images_per_row {counts} does not add up to the {grids.shape[0]} images of image_grid_thw"
            )
        checked = [check_grid(g) for g in grids.tolist()]  # before anything is sized by a grid
        sizes = [t * h * w for t, h, w in checked]
        if sum(sizes) != pixel_values.shape[0]:
            raise ValueError(f"image_grid_thw holds {sum(sizes)} patches, pixel_values {pixel_values.shape[0]}")
        images = [Image(pv, g) for pv, g in zip(torch.split(pixel_values, sizes), checked)]
        rows, at = [], 0
        for n in counts:
            rows.append(tuple(images[at : at + n]))
            at += n
        return cls(batch, tuple(rows))


def _checked_positions(batch: RolloutBatch, positions: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    rows = tuple(positions)
    if len(rows) != batch.batch_size:
        raise ValueError(f"positions are given for {len(rows)} rows, the batch has {batch.batch_size}")
    lens = (batch.prompt_mask.bool().sum(1) + batch.response_mask.bool().sum(1)).tolist()
    for i, (pos, n) in enumerate(zip(rows, lens)):
        if not isinstance(pos, torch.Tensor) or pos.is_floating_point() or tuple(pos.shape) != (3, n):
            shape = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
            raise ValueError(f"positions of row {i} must be an integer [3, {n}] tensor (its real tokens), got {shape}")
    return rows


def distinct_images(rows: Sequence[Sequence[Image]], share: bool = True) -> tuple[list[Image], list[list[int]]]:
    """The distinct images of a batch (numbered by first appearance) and each row's images as those
    numbers. `share=False`: every occurrence its own image (the plain computation's encoding)."""
    distinct: list[Image] = []
    ids: list[list[int]] = []
    buckets: dict[tuple, list[int]] = {}
    keys = iter(content_keys([img for row in rows for img in row]) if share else [])
    for row in rows:
        row_ids = []
        for img in row:
            if not share:
                row_ids.append(len(distinct))
                distinct.append(img)
                continue
            key = next(keys)
            same = next((j for j in buckets.get(key, ()) if distinct[j].same_content(img)), None)
            if same is None:
                same = len(distinct)
                distinct.append(img)
                buckets.setdefault(key, []).append(same)
            row_ids.append(same)
        ids.append(row_ids)
    return distinct, ids


def whole_prompt_groups(
    batch: RolloutBatch,
    image_ids: Sequence[Sequence[int]],
    dedup: bool = True,
    positions: Optional[Sequence[torch.Tensor]] = None,
) -> torch.Tensor:
    """[B] group of each row by its whole prompt (text tokens and images; with `positions`, also the
    prompt tokens' given positions), numbered by first appearance; every row its own group without
    `dedup`."""
    if not dedup:
        return torch.arange(batch.batch_size, device=batch.device)
    text = prompt_groups(batch.prompts, batch.prompt_mask, left_padded=True).tolist()
    if positions is None:
        placed: list[tuple] = [()] * len(text)
    else:
        plens = batch.prompt_mask.bool().sum(1).tolist()
        placed = [tuple(pos[:, :n].flatten().tolist()) for pos, n in zip(positions, plens)]
    first: dict[tuple, int] = {}
    groups = [first.setdefault((t, tuple(ids), p), len(first)) for t, ids, p in zip(text, image_ids, placed)]
    return torch.tensor(groups, dtype=torch.long, device=batch.device)


def mrope_positions(
    plan: PromptPlan, prompt_positions: Sequence[torch.Tensor], next_position: torch.Tensor
) -> torch.Tensor:
    """[3, T] rotary positions of the packed row.

    `prompt_positions[g]`: [3, L_g] the model's positions of unique prompt g (its get_rope_index);
    `next_position[g]`: the position the model gives the first text token after prompt g (all
    three sections alike). A prompt token takes its prompt's position; response token j takes
    next_position[g] + j, as in the model's numbering of the whole row (text continues by one)."""
    g_count = plan.num_groups
    if len(prompt_positions) != g_count or next_position.shape != (g_count,):
        raise ValueError(f"positions are given for {len(prompt_positions)} prompts, the plan has {g_count}")
    dev = plan.input_ids.device
    lens = torch.tensor([p.shape[1] for p in prompt_positions], device=dev)
    if not torch.equal(lens, plan.prompt_lens.to(dev)):
        raise ValueError(f"prompt positions of lengths {lens.tolist()}, the plan's prompts {plan.prompt_lens.tolist()}")
    flat = torch.cat([p.to(dev) for p in prompt_positions], 1)
    flat_start = torch.cumsum(lens, 0) - lens
    t = plan.num_tokens
    g = plan.token_group
    is_prompt = plan.token_segment < g_count
    offset = torch.arange(t, device=dev) - plan.prompt_start[g]
    prompt_pos = flat[:, (flat_start[g] + offset).clamp(0, flat.shape[1] - 1)]
    # plan.position_ids of a response token is prompt_len + j: shifted onto the model's numbering.
    response_pos = (plan.position_ids - plan.prompt_lens[g] + next_position.to(dev)[g]).expand(3, t)
    return torch.where(is_prompt[None, :], prompt_pos, response_pos)


def given_positions(plan: PromptPlan, positions: Sequence[torch.Tensor], prompt_lens: torch.Tensor) -> torch.Tensor:
    """[3, T] rotary positions of the packed row from each row's given positions (`positions[b]`:
    [3, prompt_lens[b] + response_len[b]]): a prompt token takes its group's first row's position
    (rows share a group only when their prompt positions are equal: `whole_prompt_groups`), response
    token j of row b takes row b's position prompt_lens[b] + j. So the packed row holds exactly the
    positions the trainer gave each row."""
    dev = plan.input_ids.device
    lens = torch.tensor([p.shape[1] for p in positions], device=dev)
    flat = torch.cat([p.to(dev) for p in positions], 1)
    row_start = torch.cumsum(lens, 0) - lens
    t = torch.arange(plan.num_tokens, device=dev)
    g = plan.token_group
    is_prompt = plan.token_segment < plan.num_groups
    row = torch.where(is_prompt, plan.group_rep_row.to(dev)[g], (plan.token_segment - plan.num_groups).clamp(min=0))
    plen = prompt_lens.to(dev)
    column = torch.where(is_prompt, t - plan.prompt_start[g], plen[row] + t - plan.response_start[row])
    if bool((column < 0).any()) or bool((column >= lens[row]).any()):
        raise ValueError("the given positions do not cover the packed row's tokens")
    return flat[:, row_start[row] + column]


def image_slots(
    batch: RolloutBatch, image_ids: Sequence[Sequence[int]], tokens_of: Sequence[int], image_token_id: int
) -> torch.Tensor:
    """[B, P] the slot of each real prompt token that is an image placeholder (-1 elsewhere): its row
    in the distinct images' embeddings concatenated, image i's k-th token at sum(tokens_of[:i]) + k.
    `tokens_of[i]`: placeholder tokens of distinct image i (the caller checked each prompt holds them)."""
    dev = batch.device
    n = torch.tensor([0, *tokens_of], dtype=torch.long)
    offset = torch.cumsum(n, 0)
    is_image = (batch.prompts == image_token_id) & batch.prompt_mask.bool()
    slots = torch.full(batch.prompts.shape, -1, dtype=torch.long, device=dev)
    for r, ids in enumerate(image_ids):
        if not ids:
            continue
        row = torch.cat([torch.arange(int(offset[i]), int(offset[i + 1])) for i in ids]).to(dev)
        at = is_image[r].nonzero().flatten()
        if at.numel() != row.numel():
            raise ValueError(
                f"prompt of row {r} holds {at.numel()} image placeholder tokens, its images need {row.numel()}"
            )
        slots[r, at] = row
    return slots


def image_trie_plan(
    batch: RolloutBatch, slots: torch.Tensor, image_token_id: int, vocab_size: int, min_shared_tokens: int
) -> tuple[TriePlan, torch.Tensor]:
    """The prefix-tree plan of a batch with images, and [T] the slot of each packed token (-1: not an
    image token). The trie compares image placeholders by slot (image and place in it), so a shared
    run holds the same text and the same images; the plan's input_ids are the real token ids."""
    batch.check_vocab(vocab_size)
    key_base = max(vocab_size, int(batch.prompts.max()) + 1)
    keyed = torch.where(slots >= 0, key_base + slots, batch.prompts.long())
    plan = build_trie_plan(
        RolloutBatch.of_validated(keyed, batch.prompt_mask, batch.responses, batch.response_mask),
        min_shared_tokens=min_shared_tokens,
    )
    token_slot = torch.where(plan.input_ids >= key_base, plan.input_ids - key_base, -1)
    real = torch.where(token_slot >= 0, torch.full_like(plan.input_ids, image_token_id), plan.input_ids)
    return replace(plan, input_ids=real), token_slot


def trie_row_index(plan: TriePlan) -> list[torch.Tensor]:
    """Per row, [L_b] the packed position of each token of the row (prompt then response): its path
    from the root to the node it ends in."""
    parent, start, length = plan.node_parent.tolist(), plan.node_start.tolist(), plan.node_len.tolist()
    out = []
    for n in plan.row_node.tolist():
        path = []
        while n >= 0:
            path.append(n)
            n = parent[n]
        out.append(torch.cat([torch.arange(start[m], start[m] + length[m]) for m in reversed(path)]))
    return [x.to(plan.device) for x in out]


def trie_mrope_positions(plan: TriePlan, row_positions: Sequence[torch.Tensor]) -> torch.Tensor:
    """[3, T] rotary positions of the packed trie row from `row_positions[b]` ([3, L_b], the model's own
    numbering of row b's prompt and response). Raises RuntimeError when two rows through a packed
    token number it differently (a shared run must be numbered alike by every row through it)."""
    index = trie_row_index(plan)
    if len(row_positions) != len(index):
        raise ValueError(f"positions are given for {len(row_positions)} rows, the plan has {len(index)}")
    for b, (pos, at) in enumerate(zip(row_positions, index)):
        if pos.shape != (3, at.numel()):
            raise ValueError(f"positions of row {b} have shape {tuple(pos.shape)}, its path {at.numel()} tokens")
    at = torch.cat(index)
    values = torch.cat([p.to(plan.device) for p in row_positions], 1).long()
    out = torch.full((3, plan.num_tokens), -1, dtype=torch.long, device=plan.device)
    out[:, at] = values
    if bool((out < 0).any()) or not torch.equal(out[:, at], values):
        raise RuntimeError(
            "rows that share a packed token give it different 3-D positions: the prefix plan cannot share it"
        )
    return out
