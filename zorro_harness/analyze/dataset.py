"""A user's dataset of prompts or dumped rollouts, read and tokenized for `zorro analyze --data`.

Formats (zorro_harness.analyze.readers): parquet and JSON lines. Columns, found by name unless given
(`prompt_column`, `completion_column`), checked row by row (zorro_harness.analyze.columns):
- token ids: `prompt_ids` / `prompt_token_ids` / `input_ids`, and `completion_ids` / `response_ids` /
  `completion_token_ids` (used as they are, no tokenizer needed);
- text or chat: `prompt` (a string, or a list of {role, content} messages: verl's prompt parquet, TRL's
  conversational format) and `completion` / `response` (a string or messages); or `messages` (a whole
  conversation: the prompt is every message before the last assistant one, the completion that one).

Tokenization (zorro_harness.analyze.tokenize: local tokenizers only, as the trainers do it; chat
templates rendered within limits by zorro_harness.analyze.chat_template). A chat completion is the
tokens that rendering prompt + completion adds after the prompt's tokens (TRL's way).

Errors are `DatasetError` (a ValueError) whose message starts with the file's name.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from zorro_harness.analyze.columns import (
    check_rows,
    check_vocab,
    column_values,
    ids_column,
    pick_column,
    value_kind,
)
from zorro_harness.analyze.images import (
    IMAGE_COLUMNS,
    IMAGE_GRID_COLUMNS,
    IMAGE_TOKEN,
    SPATIAL_MERGE,
    DataImages,
    expand_images,
)
from zorro_harness.analyze.ragged import Ragged, ragged_arange
from zorro_harness.analyze.readers import (
    COLUMNS_READ,
    COMPLETION_COLUMNS,
    COMPLETION_ID_COLUMNS,
    PROMPT_COLUMNS,
    PROMPT_ID_COLUMNS,
    DatasetError,
    read_columns,
)
from zorro_harness.analyze.tokenize import LocalTokenizer, Progress, encode_texts

__all__ = ["COMPLETION_SAMPLE", "DatasetError", "Progress", "Ragged", "TokenizedData", "load_dataset"]

# Limits that lived here before the reading, tokenizing and rendering moved to their own modules.
_MOVED = {
    "MAX_LINE_BYTES": "zorro_harness.analyze.readers",
    "SPLIT_CHECK_ROWS": "zorro_harness.analyze.tokenize",
    "TOKENIZER_FILES": "zorro_harness.analyze.tokenize",
    "RENDER_SECONDS": "zorro_harness.analyze.chat_template",
    "MAX_RENDER_CHARS": "zorro_harness.analyze.chat_template",
    "MAX_TEMPLATE_CHARS": "zorro_harness.analyze.chat_template",
}


def __getattr__(name: str) -> Any:
    """The moved limits, still importable from here with a DeprecationWarning naming their module."""
    if name in _MOVED:
        warnings.warn(
            f"zorro_harness.analyze.dataset.{name} moved to {_MOVED[name]}.{name} (removed after 2027-06-01)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


COMPLETION_SAMPLE = 10_000
"""`load_dataset(completions="sample")` tokenizes this many completions (a seeded random sample): where
only their length distribution is needed, that is enough, and it halves the tokenizer's work."""


@dataclass
class TokenizedData:
    """What `load_dataset` read: prompts (and completions) as token ids, and how they were found."""

    path: str
    format: str
    """parquet or jsonl."""
    kind: str
    """token_ids, text or chat."""
    prompt_column: str
    completion_column: Optional[str]
    prompts: Ragged
    completions: Optional[Ragged]
    split_tokenization: bool = False
    """Whether distinct pieces between special tokens were encoded once each (checked on a sample)."""
    completions_sampled: bool = False
    """Whether `completions` holds a random sample of the rows' completions (not row-aligned)."""
    images: Optional[DataImages] = None
    """The prompts' images (their tokens are in `prompts`, keyed by image), or None without images."""

    @property
    def rows(self) -> int:
        return len(self.prompts)


def _split_messages(path: str, convs: list) -> tuple[list, list]:
    """A `messages` column: (every message before the last assistant one, that one)."""
    prompts, completions = [], []
    for i, c in enumerate(convs):
        c = list(c)
        last = max((j for j, m in enumerate(c) if m.get("role") == "assistant"), default=None)
        if last is None or last == 0:
            raise DatasetError(f"{path}: row {i} of column 'messages' has no assistant message after a prompt")
        prompts.append(c[:last])
        completions.append(c[last : last + 1])
    return prompts, completions


def load_dataset(
    path: str,
    tokenizer: Optional[str] = None,
    prompt_column: Optional[str] = None,
    completion_column: Optional[str] = None,
    chat_template: Optional[str] = None,
    progress: Progress = None,
    completions: str = "all",
    vocab_size: Optional[int] = None,
    chat_template_name: Optional[str] = None,
    image_grid_column: Optional[str] = None,
    image_column: Optional[str] = None,
    image_token_id: Optional[int] = None,
    spatial_merge: int = SPATIAL_MERGE,
) -> TokenizedData:
    """Read `path` and tokenize its prompts (and completions: "all", or "sample" for a random
    COMPLETION_SAMPLE of them, enough for their length distribution); see the module docstring.
    Every row is checked; with `vocab_size`, every token id against it. `chat_template_name` names
    `chat_template` in errors (its file). With an image grid column (`image_grid_thw`, or
    `image_grid_column`), each prompt's image placeholders become its images' tokens
    (zorro_harness.analyze.images; `image_token_id` default: the tokenizer's <|image_pad|>)."""
    if completions not in ("all", "sample"):
        raise ValueError(f"completions must be 'all' or 'sample', got {completions!r}")
    named = {c for c in (prompt_column, completion_column, image_grid_column, image_column) if c}
    fmt, columns = read_columns(path, COLUMNS_READ | set(IMAGE_GRID_COLUMNS + IMAGE_COLUMNS) | named)
    with_images = functools.partial(
        _with_images,
        columns=columns,
        grid_column=pick_column(path, columns, image_grid_column, IMAGE_GRID_COLUMNS, "image grid"),
        image_column=pick_column(path, columns, image_column, IMAGE_COLUMNS, "images"),
        image_token_id=image_token_id,
        vocab_size=vocab_size,
        merge=spatial_merge,
    )
    pcol = pick_column(path, columns, prompt_column, PROMPT_ID_COLUMNS + PROMPT_COLUMNS, "prompt")
    if pcol is None:
        raise DatasetError(
            f"{path}: no prompt column (looked for {', '.join(PROMPT_ID_COLUMNS + PROMPT_COLUMNS)}; "
            f"columns: {', '.join(columns)}; give --prompt-column)"
        )
    pcolumn = columns[pcol]
    kind = value_kind(path, pcol, pcolumn)
    ccol = pick_column(
        path,
        columns,
        completion_column,
        COMPLETION_ID_COLUMNS if kind == "token_ids" else COMPLETION_COLUMNS,
        "completion",
    )
    if kind == "token_ids":
        prompts = ids_column(path, pcol, pcolumn)
        ids = None
        if ccol is not None:
            if value_kind(path, ccol, columns[ccol]) != "token_ids":
                raise DatasetError(f"{path}: prompt column {pcol!r} holds token ids but {ccol!r} does not")
            ids = ids_column(path, ccol, columns[ccol])
        data = TokenizedData(path, fmt, kind, pcol, ccol, prompts, ids)
        _check_data_vocab(data, vocab_size)
        return with_images(data, tokenizer=None)
    pvals = column_values(pcolumn)
    check_rows(path, pcol, pvals, kind)
    cvals = column_values(columns[ccol]) if ccol else None
    if tokenizer is None:
        raise DatasetError(f"{path}: column {pcol!r} holds {kind}, not token ids: give --tokenizer PATH (local)")
    tok = LocalTokenizer(tokenizer, chat_template, chat_template_name)
    if kind == "chat" and pcol == "messages" and ccol is None:
        pvals, cvals = _split_messages(path, pvals)
        ccol = "messages"
    elif cvals is not None:
        ckind = value_kind(path, ccol, cvals)  # type: ignore[arg-type]
        if ckind != "text" and not (kind == "chat" and ckind == "chat"):
            raise DatasetError(f"{path}: prompt column {pcol!r} holds {kind} but {ccol!r} holds {ckind}")
        check_rows(path, ccol, cvals, ckind)  # type: ignore[arg-type]
    sample = np.arange(len(pvals))
    if cvals is not None and completions == "sample" and len(cvals) > COMPLETION_SAMPLE:
        sample = np.sort(np.random.default_rng(0).choice(len(pvals), COMPLETION_SAMPLE, replace=False))
        cvals = [cvals[i] for i in sample.tolist()]
    if kind == "text":
        prompts, split = encode_texts(tok, pvals, True, progress)
        comp = None
        if cvals is not None:
            comp, _ = encode_texts(tok, cvals, False, progress)
        data = TokenizedData(path, fmt, kind, pcol, ccol, prompts, comp, split, sample.size < len(pvals))
        _check_data_vocab(data, vocab_size)
        return with_images(data, tokenizer=tok)
    convs = [list(c) for c in pvals]
    cache: dict[str, list[int]] = {}
    prompts, split = encode_texts(tok, tok.render(path, convs, True), False, progress, cache)
    comp = None
    if cvals is not None:
        picked = [convs[i] for i in sample.tolist()]
        if isinstance(cvals[0], str):
            full = [c + [{"role": "assistant", "content": x}] for c, x in zip(picked, cvals)]
        else:
            full = [c + list(x) for c, x in zip(picked, cvals)]
        whole, _ = encode_texts(tok, tok.render(path, full, False), False, progress, cache)
        comp = _suffix(path, whole, _take(prompts, sample))
    data = TokenizedData(path, fmt, kind, pcol, ccol, prompts, comp, split, sample.size < len(pvals))
    _check_data_vocab(data, vocab_size)
    return with_images(data, tokenizer=tok)


def _with_images(
    data: TokenizedData,
    tokenizer: Optional[LocalTokenizer],
    columns: dict,
    grid_column: Optional[str],
    image_column: Optional[str],
    image_token_id: Optional[int],
    vocab_size: Optional[int],
    merge: int,
) -> TokenizedData:
    """`data` with its prompts' images as their tokens (after the vocabulary check: image tokens are
    keyed past the vocabulary), or as it is without an image grid column."""
    if grid_column is None:
        if image_column is not None:  # their tokens cannot be counted: refused rather than left out
            raise DatasetError(
                f"{data.path}: column {image_column!r} holds images but the data has no image grid column "
                f"({', '.join(IMAGE_GRID_COLUMNS)}: per row, each image's [t, h, w] patch grid as the processor "
                "gives it; or --image-grid-column)"
            )
        return data
    if image_token_id is None:
        backend = getattr(tokenizer, "backend", None) if tokenizer is not None else None
        found = backend.token_to_id(IMAGE_TOKEN) if backend is not None else None
        if found is None:
            raise DatasetError(
                f"{data.path}: column {grid_column!r} holds image grids: give --image-token-id (the image "
                f"placeholder's id; the tokenizer has no {IMAGE_TOKEN})"
            )
        image_token_id = int(found)
    key_base = max(int(vocab_size or 0), int(data.prompts.flat.max(initial=0)) + 1)
    images = column_values(columns[image_column]) if image_column is not None else None
    prompts, found_images = expand_images(
        data.path,
        data.prompts,
        grid_column,
        column_values(columns[grid_column]),
        image_column,
        images,
        image_token_id,
        key_base,
        merge,
    )
    data.prompts, data.images = prompts, found_images
    return data


def _check_data_vocab(data: TokenizedData, vocab_size: Optional[int]) -> None:
    if vocab_size is None:
        return
    check_vocab(data.path, data.prompt_column, data.prompts, vocab_size)
    if data.completions is not None and data.completion_column is not None:
        check_vocab(data.path, data.completion_column, data.completions, vocab_size)


def _take(r: Ragged, rows: np.ndarray) -> Ragged:
    lens = r.lens[rows]
    offsets = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return Ragged(r.flat[ragged_arange(r.offsets[rows], lens)], offsets)


def _suffix(path: str, whole: Ragged, prompts: Ragged) -> Ragged:
    """whole[i] minus its first len(prompts[i]) tokens (the completion's tokens, TRL's way)."""
    clens = whole.lens - prompts.lens
    bad = np.flatnonzero(clens < 1)
    if bad.size:
        raise DatasetError(
            f"{path}: {bad.size} row(s) have an empty completion after the chat template (first: row {bad[0]})"
        )
    offsets = np.zeros(len(clens) + 1, dtype=np.int64)
    np.cumsum(clens, out=offsets[1:])
    return Ragged(whole.flat[ragged_arange(whole.offsets[:-1] + prompts.lens, clens)], offsets)
