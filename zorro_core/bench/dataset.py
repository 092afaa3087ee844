"""A user's dataset of prompts or dumped rollouts, read and tokenized for `zorro analyze --data`.

Formats: parquet (pyarrow) and JSON lines (`.jsonl`, `.json` with one object a line). Columns, found
by name unless given (`prompt_column`, `completion_column`):
- token ids: `prompt_ids` / `prompt_token_ids` / `input_ids`, and `completion_ids` / `response_ids` /
  `completion_token_ids` (used as they are, no tokenizer needed);
- text or chat: `prompt` (a string, or a list of {role, content} messages: verl's prompt parquet, TRL's
  conversational format) and `completion` / `response` (a string or messages); or `messages` (a whole
  conversation: the prompt is every message before the last assistant one, the completion that one).

Tokenization (local tokenizers only, nothing is downloaded), as the trainers do it: a chat prompt is
rendered with the tokenizer's chat template and `add_generation_prompt=True` and tokenized without
adding special tokens (the template holds them); a text prompt is tokenized with them (BOS where the
tokenizer adds one); a text completion without. A chat completion is the tokens that rendering
prompt + completion adds after the prompt's tokens (TRL's way).

Speed: rendered texts are split at the tokenizer's special tokens (where HF tokenizers split them
anyway) and each distinct piece is tokenized once: a system prompt or an earlier turn shared by many
rows costs one encode. The split is checked against whole-text encodes on a sample of rows and
dropped (whole texts are encoded) if any differs.

Errors are `DatasetError` (a ValueError) whose message starts with the file's name.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

PROMPT_ID_COLUMNS = ("prompt_ids", "prompt_token_ids", "input_ids")
COMPLETION_ID_COLUMNS = ("completion_ids", "response_ids", "completion_token_ids")
PROMPT_COLUMNS = ("prompt", "messages")
COMPLETION_COLUMNS = ("completion", "response")
SPLIT_CHECK_ROWS = 256
"""Rows whose piecewise tokenization is compared with a whole-text encode."""
COMPLETION_SAMPLE = 10_000
"""`load_dataset(completions="sample")` tokenizes this many completions (a seeded random sample): where
only their length distribution is needed, that is enough, and it halves the tokenizer's work."""

Progress = Optional[Callable[[str, int, int], None]]
"""progress(stage, done, total), called as work advances (the CLI draws a bar)."""


class DatasetError(ValueError):
    """A dataset or tokenizer that cannot be analysed; the message names the file and the problem."""


@dataclass
class Ragged:
    """Token-id sequences as one flat array and offsets: sequence i is flat[offsets[i]:offsets[i + 1]]."""

    flat: np.ndarray
    offsets: np.ndarray

    @property
    def lens(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]]) -> "Ragged":
        lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(offsets[-1]))
        return cls(flat, offsets)

    def concat(self, other: "Ragged") -> "Ragged":
        """Row i of self followed by row i of other."""
        lens = self.lens + other.lens
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        idx_a = ragged_arange(offsets[:-1], self.lens)
        idx_b = ragged_arange(offsets[:-1] + self.lens, other.lens)
        flat = np.empty(int(offsets[-1]), dtype=np.int64)
        flat[idx_a] = self.flat
        flat[idx_b] = other.flat
        return Ragged(flat, offsets)


def ragged_arange(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lens[i]) over i, vectorised."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg_begin = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - seg_begin, lens)


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

    @property
    def rows(self) -> int:
        return len(self.prompts)


# -- reading ---------------------------------------------------------------------------------------


def read_columns(path: str) -> tuple[str, dict[str, list]]:
    """(format, {column: values}) of a parquet or JSON-lines file; DatasetError names what is wrong."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such file")
    lower = name.lower()
    if lower.endswith(".parquet"):
        return "parquet", _read_parquet(path)
    if lower.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl", _read_jsonl(path)
    raise DatasetError(f"{path}: unknown format (expected .parquet or .jsonl)")


def _read_parquet(path: str) -> dict[str, list]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:  # pragma: no cover - pyarrow is in the cli extra
        raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install 'zorro[cli]')") from e
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e
    if table.num_rows == 0:
        raise DatasetError(f"{path}: empty file (no rows)")
    return {c: table.column(c) for c in table.column_names}  # columns converted lazily (to_pylist)


def _read_jsonl(path: str) -> dict[str, list]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: line {n} is not JSON ({e.msg})") from e
            if not isinstance(obj, dict):
                raise DatasetError(f"{path}: line {n} is not a JSON object")
            rows.append(obj)
    if not rows:
        raise DatasetError(f"{path}: empty file (no rows)")
    columns: dict[str, list] = {}
    for k in rows[0]:
        columns[k] = [r.get(k) for r in rows]
    return columns


def _values(col) -> list:
    return col.to_pylist() if hasattr(col, "to_pylist") else list(col)


def _pick(path: str, columns: dict, given: Optional[str], candidates: Sequence[str], what: str) -> Optional[str]:
    if given is not None:
        if given not in columns:
            raise DatasetError(f"{path}: no column {given!r} (columns: {', '.join(columns)})")
        return given
    return next((c for c in candidates if c in columns), None)


def _value_kind(path: str, column: str, values: list) -> str:
    """token_ids, text or chat, from the column's values (every row must have one)."""
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise DatasetError(f"{path}: column {column!r} is empty in {len(missing)} row(s) (first: row {missing[0]})")
    v = values[0]
    if isinstance(v, str):
        return "text"
    if isinstance(v, (list, tuple)) or hasattr(v, "tolist"):
        v = list(v)
        if not v:
            raise DatasetError(f"{path}: column {column!r} row 0 is an empty list")
        if all(isinstance(t, (int, np.integer)) for t in v[:16]):
            return "token_ids"
        if all(isinstance(m, dict) and "role" in m and "content" in m for m in v):
            return "chat"
    raise DatasetError(
        f"{path}: column {column!r} holds neither text, chat messages ({{role, content}}) nor token ids "
        f"(row 0: {type(values[0]).__name__})"
    )


# -- tokenizers ------------------------------------------------------------------------------------


class LocalTokenizer:
    """A local tokenizer (a directory, or a tokenizer.json) with its chat template, if it has one."""

    def __init__(self, path: str, chat_template: Optional[str] = None):
        self.path = path
        self.hf = None
        self.specials: dict[str, Any] = {}
        if os.path.isdir(path):
            try:
                from transformers import AutoTokenizer

                self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
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
            template = chat_template or _sibling_template(path, self.specials)
        else:
            raise DatasetError(f"{path}: no such tokenizer (a local directory or a tokenizer.json)")
        self.chat_template = template
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
        if self._compiled is None:
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self._compiled = _compile_jinja_template(self.chat_template)
            except Exception as e:
                raise DatasetError(f"{self.path}: the chat template does not compile ({e})") from e
        extra = {k: v for k, v in self.specials.items() if v is not None}
        compiled = self._compiled
        try:
            return [
                compiled.render(messages=c, add_generation_prompt=add_generation_prompt, **extra) for c in conversations
            ]
        except Exception as e:
            raise DatasetError(f"{data_path}: the chat template fails on a row ({type(e).__name__}: {e})") from e


def _sibling_template(path: str, specials: dict) -> Optional[str]:
    """A tokenizer.json's chat template: chat_template.jinja or tokenizer_config.json beside it."""
    folder = os.path.dirname(os.path.abspath(path))
    cfg = os.path.join(folder, "tokenizer_config.json")
    template = None
    if os.path.isfile(cfg):
        try:
            with open(cfg, encoding="utf-8") as f:
                conf = json.load(f)
        except Exception:
            conf = {}
        template = conf.get("chat_template")
        for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = conf.get(k)
            specials[k] = v.get("content") if isinstance(v, dict) else v
    jinja = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    return template if isinstance(template, str) else None


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


# -- the dataset -----------------------------------------------------------------------------------


def _ids_column(path: str, column: str, values: list) -> Ragged:
    rows = [list(v) for v in values]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise DatasetError(f"{path}: column {column!r} is an empty list in {len(empty)} row(s) (first: row {empty[0]})")
    ids = Ragged.from_lists(rows)
    if ids.flat.size and int(ids.flat.min()) < 0:
        raise DatasetError(f"{path}: column {column!r} holds negative token ids")
    return ids


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
) -> TokenizedData:
    """Read `path` and tokenize its prompts (and completions: "all", or "sample" for a random
    COMPLETION_SAMPLE of them, enough for their length distribution); see the module docstring."""
    if completions not in ("all", "sample"):
        raise ValueError(f"completions must be 'all' or 'sample', got {completions!r}")
    fmt, columns = read_columns(path)
    pcol = _pick(path, columns, prompt_column, PROMPT_ID_COLUMNS + PROMPT_COLUMNS, "prompt")
    if pcol is None:
        raise DatasetError(
            f"{path}: no prompt column (looked for {', '.join(PROMPT_ID_COLUMNS + PROMPT_COLUMNS)}; "
            f"columns: {', '.join(columns)}; give --prompt-column)"
        )
    pvals = _values(columns[pcol])
    kind = _value_kind(path, pcol, pvals)
    ccol = _pick(
        path,
        columns,
        completion_column,
        COMPLETION_ID_COLUMNS if kind == "token_ids" else COMPLETION_COLUMNS,
        "completion",
    )
    cvals = _values(columns[ccol]) if ccol else None
    if kind == "token_ids":
        prompts = _ids_column(path, pcol, pvals)
        ids = None
        if cvals is not None:
            if _value_kind(path, ccol, cvals) != "token_ids":  # type: ignore[arg-type]
                raise DatasetError(f"{path}: prompt column {pcol!r} holds token ids but {ccol!r} does not")
            ids = _ids_column(path, ccol, cvals)  # type: ignore[arg-type]
        return TokenizedData(path, fmt, kind, pcol, ccol, prompts, ids)
    if tokenizer is None:
        raise DatasetError(f"{path}: column {pcol!r} holds {kind}, not token ids: give --tokenizer PATH (local)")
    tok = LocalTokenizer(tokenizer, chat_template)
    if kind == "chat" and pcol == "messages" and ccol is None:
        pvals, cvals = _split_messages(path, pvals)
        ccol = "messages"
    sample = np.arange(len(pvals))
    if cvals is not None and completions == "sample" and len(cvals) > COMPLETION_SAMPLE:
        sample = np.sort(np.random.default_rng(0).choice(len(pvals), COMPLETION_SAMPLE, replace=False))
        cvals = [cvals[i] for i in sample.tolist()]
    if kind == "text":
        prompts, split = encode_texts(tok, pvals, True, progress)
        comp = None
        if cvals is not None:
            if _value_kind(path, ccol, cvals) != "text":  # type: ignore[arg-type]
                raise DatasetError(f"{path}: prompt column {pcol!r} holds text but {ccol!r} does not")
            comp, _ = encode_texts(tok, cvals, False, progress)
        return TokenizedData(path, fmt, kind, pcol, ccol, prompts, comp, split, sample.size < len(pvals))
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
    return TokenizedData(path, fmt, kind, pcol, ccol, prompts, comp, split, sample.size < len(pvals))


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
