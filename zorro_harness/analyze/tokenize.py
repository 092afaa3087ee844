"""Local tokenizers (nothing is downloaded) and tokenizing many texts fast.

Tokenization as the trainers do it: a chat prompt is rendered with the tokenizer's chat template and
`add_generation_prompt=True` and tokenized without adding special tokens (the template holds them); a
text prompt is tokenized with them (BOS where the tokenizer adds one); a text completion without.

Speed: rendered texts are split at the tokenizer's special tokens (where HF tokenizers split them
anyway) and each distinct piece is tokenized once: a system prompt or an earlier turn shared by many
rows costs one encode. The split is checked against whole-text encodes on a sample of rows and
dropped (whole texts are encoded) if any differs.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Optional

import numpy as np

from zorro_core.models.local_files import hub_offline, refuse_remote_code
from zorro_harness.analyze.chat_template import compile_template, render_limited, sibling_template
from zorro_harness.analyze.ragged import Ragged, ragged_arange
from zorro_harness.analyze.readers import DatasetError

SPLIT_CHECK_ROWS = 256
"""Rows whose piecewise tokenization is compared with a whole-text encode."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""Files of which a tokenizer directory holds at least one."""

Progress = Optional[Callable[[str, int, int], None]]
"""progress(stage, done, total), called as work advances (the CLI draws a bar)."""


class LocalTokenizer:
    """A local tokenizer (a directory, or a tokenizer.json) with its chat template, if it has one."""

    def __init__(self, path: str, chat_template: Optional[str] = None, chat_template_name: Optional[str] = None):
        self.path = path
        self.hf = None
        self.specials: dict[str, Any] = {}
        if os.path.isdir(path):
            if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
                raise DatasetError(
                    f"{path}: no tokenizer files in the directory (looked for {', '.join(TOKENIZER_FILES)})"
                )
            try:
                from transformers import AutoTokenizer

                refuse_remote_code(path, "tokenizer")
                with hub_offline():
                    self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            except Exception as e:
                raise DatasetError(f"{path}: cannot read the tokenizer ({type(e).__name__}: {e})") from e
            self.backend = getattr(self.hf, "backend_tokenizer", None)
            template = chat_template or getattr(self.hf, "chat_template", None)
            self.specials = {k: getattr(self.hf, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        elif os.path.isfile(path):
            try:
                from tokenizers import Tokenizer

                self.backend = Tokenizer.from_file(path)
            except Exception as e:
                raise DatasetError(f"{path}: cannot read the tokenizer ({type(e).__name__}: {e})") from e
            template = chat_template or sibling_template(path, self.specials)
        else:
            raise DatasetError(f"{path}: no such tokenizer (a local directory or a tokenizer.json)")
        self.chat_template = template
        self.template_name = chat_template_name or (
            f"the chat template of {path}" if chat_template is None else "the chat template given"
        )
        self._compiled: Any = None

    def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        if not texts:
            return []
        if self.backend is not None:
            return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return list(self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"])  # type: ignore[misc]

    def special_tokens(self) -> list[str]:
        """The contents of the special added tokens (where the tokenizer splits text first)."""
        if self.backend is None:
            return []
        return [t.content for t in self.backend.get_added_tokens_decoder().values() if t.special and t.content]

    def render(self, data_path: str, conversations: list[list[dict]], add_generation_prompt: bool) -> list[str]:
        if not self.chat_template:
            raise DatasetError(
                f"{data_path}: the rows are chat messages but the tokenizer {self.path} has no chat template "
                "(give --chat-template FILE)"
            )
        name = self.template_name
        if self._compiled is None:
            self._compiled = compile_template(self.chat_template, name)
        extra = {k: v for k, v in self.specials.items() if v is not None}
        out = []
        for i, c in enumerate(conversations):
            try:
                out.append(
                    render_limited(
                        self._compiled, name, messages=c, add_generation_prompt=add_generation_prompt, **extra
                    )
                )
            except DatasetError as e:
                raise DatasetError(f"{e} (rendering row {i} of {data_path})") from None
            except Exception as e:
                raise DatasetError(f"{data_path}: {name} fails on row {i} ({type(e).__name__}: {e})") from e
        return out


def encode_texts(
    tok: LocalTokenizer,
    texts: list[str],
    add_special_tokens: bool,
    progress: Progress = None,
    cache: Optional[dict[str, list[int]]] = None,
) -> tuple[Ragged, bool]:
    """Token ids of `texts`, each distinct piece between special tokens encoded once (see the module
    docstring; `cache` holds pieces encoded by an earlier call); (ids, whether the split was used)."""
    cache = {} if cache is None else cache
    specials = tok.special_tokens() if not add_special_tokens else []
    if specials:
        pattern = re.compile("(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")")
        split = [[p for p in pattern.split(t) if p] for t in texts]
    else:
        split = [[t] for t in texts]
    piece_id: dict[str, int] = {}
    seq: list[int] = []
    counts = np.empty(len(texts), dtype=np.int64)
    for i, pieces in enumerate(split):
        counts[i] = len(pieces)
        for p in pieces:
            j = piece_id.get(p)
            if j is None:
                j = piece_id[p] = len(piece_id)
            seq.append(j)
    uniq = list(piece_id)
    todo = [u for u in uniq if u not in cache] if specials else uniq
    step = 8192
    for s in range(0, len(todo), step):
        chunk = todo[s : s + step]
        cache.update(zip(chunk, tok.encode(chunk, add_special_tokens)))
        if progress:
            progress("tokenize", min(s + step, len(todo)), len(todo))
    enc = [cache[u] for u in uniq]
    if not specials:
        cache.clear()  # whole texts: nothing to share with a later call
    table = Ragged.from_lists(enc)
    occ = np.asarray(seq, dtype=np.int64)
    occ_lens = table.lens[occ]
    row_off = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(counts, out=row_off[1:])
    csum = np.concatenate([[0], np.cumsum(occ_lens)])
    lens = csum[row_off[1:]] - csum[row_off[:-1]]
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    ids = Ragged(table.flat[ragged_arange(table.offsets[occ], occ_lens)], offsets)
    if specials:
        sample = list(range(0, len(texts), max(1, len(texts) // SPLIT_CHECK_ROWS)))[:SPLIT_CHECK_ROWS]
        whole = tok.encode([texts[i] for i in sample], add_special_tokens)
        if any(list(ids.row(i)) != w for i, w in zip(sample, whole)):
            return Ragged.from_lists(tok.encode(texts, add_special_tokens)), False
    return ids, bool(specials)
