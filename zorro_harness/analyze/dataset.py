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

import codecs
import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional, Sequence

import numpy as np

from zorro_core.models.local_files import hub_offline, refuse_remote_code
from zorro_harness.analyze.large_lines import LARGE_LINE_BYTES, loads_large

# Chat templates are compiled by transformers' own sandboxed compiler, so the rendering has the
# globals and filters the tokenizer's would. Its name is private: probed once here, and without it
# chat rows are refused with the reason (plain text and token-id rows need no template).
_TEMPLATE_TESTED = "transformers 5.6 to 5.24"


def _template_compiler() -> tuple[Optional[Callable[[str], Any]], str]:
    """transformers' template compiler, or None and why not."""
    try:
        from transformers.utils import chat_template_utils
    except ImportError as e:  # pragma: no cover (the module exists in every tested release)
        return None, f"transformers.utils.chat_template_utils does not import ({e})"
    compile_template = getattr(chat_template_utils, "_compile_jinja_template", None)
    if not callable(compile_template):
        return None, (
            "this transformers release has no transformers.utils.chat_template_utils._compile_jinja_template, which "
            f"zorro renders chat templates with (tested with {_TEMPLATE_TESTED}); chat rows cannot be rendered"
        )
    return compile_template, ""


_COMPILE_TEMPLATE, _NO_TEMPLATE_COMPILER = _template_compiler()

PROMPT_ID_COLUMNS = ("prompt_ids", "prompt_token_ids", "input_ids")
COMPLETION_ID_COLUMNS = ("completion_ids", "response_ids", "completion_token_ids")
PROMPT_COLUMNS = ("prompt", "messages")
COMPLETION_COLUMNS = ("completion", "response")
SPLIT_CHECK_ROWS = 256
"""Rows whose piecewise tokenization is compared with a whole-text encode."""
COMPLETION_SAMPLE = 10_000
"""`load_dataset(completions="sample")` tokenizes this many completions (a seeded random sample): where
only their length distribution is needed, that is enough, and it halves the tokenizer's work."""

MAX_LINE_BYTES = 64 * 2**20
"""The longest JSON line read (a row). A line is parsed whole; a line of LARGE_LINE_BYTES or more
has its long token-id arrays parsed by numpy (large_lines): peak memory ~2x the line, not ~10x."""
RENDER_SECONDS = 10.0
"""The longest one row's chat-template rendering may take (a template's loops are otherwise unbounded)."""
MAX_RENDER_CHARS = 64 * 2**20
"""The longest text one row's chat-template rendering may produce."""
MAX_TEMPLATE_CHARS = 2**20
"""The longest chat template compiled (real ones are a few KB; compiling takes memory in proportion)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
"""Files of which a tokenizer directory holds at least one."""
COLUMNS_READ = frozenset(PROMPT_ID_COLUMNS + COMPLETION_ID_COLUMNS + PROMPT_COLUMNS + COMPLETION_COLUMNS)
"""The columns kept by default when reading (others are only named): memory follows what is analysed."""

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
    def from_lists(cls, rows: Sequence[Sequence[int]] | Sequence[np.ndarray]) -> "Ragged":
        lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if rows and all(isinstance(r, np.ndarray) for r in rows):
            return cls(np.concatenate(rows, dtype=np.int64), offsets)  # one copy, whatever the rows' dtype
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


def read_columns(path: str, keep: Optional[Collection[str]] = None) -> tuple[str, dict[str, Any]]:
    """(format, {column: values}) of a parquet or JSON-lines file; DatasetError names what is wrong.

    Every column of the file is named; only those in `keep` (default COLUMNS_READ) hold values, the
    others None. A JSON-lines file's columns are those of any row (a row without one holds None there)."""
    keep = COLUMNS_READ if keep is None else frozenset(keep)
    name = os.path.basename(path)
    if not os.path.exists(path):
        raise DatasetError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DatasetError(f"{path}: a directory, not a data file (.parquet or .jsonl)")
    regular = os.path.isfile(path)
    lower = name.lower()
    if lower.endswith(".parquet"):
        if not regular:
            raise DatasetError(
                f"{path}: parquet is read from a regular file, not a pipe or device (write it to a file)"
            )
        return "parquet", _read_parquet(path, keep)
    if lower.endswith((".jsonl", ".json", ".ndjson")) or not regular:  # a pipe (`<(...)`) is read as JSON lines
        return "jsonl", _read_jsonl(path, keep)
    raise DatasetError(f"{path}: unknown format (expected .parquet or .jsonl)")


def _read_parquet(path: str, keep: frozenset) -> dict[str, Any]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as e:  # pragma: no cover - pyarrow is in the cli extra
        raise DatasetError(f"{path}: reading parquet needs pyarrow (pip install 'zorro[cli]')") from e
    try:
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in names if c in keep])
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from e
    if rows == 0:
        raise DatasetError(f"{path}: empty file (no rows)")
    # Columns stay arrow arrays: token ids are checked and flattened there, text converted when used.
    return {c: (table.column(c) if c in keep else None) for c in names}


def _read_jsonl(path: str, keep: frozenset) -> dict[str, Any]:
    names: dict[str, None] = {}
    kept: dict[str, list] = {}
    rows = 0
    with open(path, "rb") as f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                raise DatasetError(
                    f"{path}: line {n} is over {MAX_LINE_BYTES:,} bytes (one row a line, each at most that)"
                )
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if len(raw) >= LARGE_LINE_BYTES:  # its long id arrays parsed by numpy, not as Python ints
                if not rows and raw.lstrip().startswith(b"["):
                    raise DatasetError(
                        f"{path}: line {n} starts a JSON array; zorro reads JSON lines, one JSON object per line"
                    )
                obj = _json_line(path, n, raw)
            else:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{path}: line {n} is not UTF-8 (byte {e.start + 1}: {e.reason})") from None
                if not line.strip():
                    continue
                if not rows and line.lstrip().startswith("["):
                    raise DatasetError(
                        f"{path}: line {n} starts a JSON array; zorro reads JSON lines, one JSON object per line"
                    )
                obj = _json_line(path, n, line)
            for k, v in obj.items():
                if k not in names:
                    names[k] = None
                if k in keep:
                    col = kept.get(k)
                    if col is None:
                        col = kept[k] = [None] * rows
                    col.append(_compact(v))
            rows += 1
            for col in kept.values():
                if len(col) < rows:
                    col.append(None)
    if not rows:
        raise DatasetError(f"{path}: empty file (no rows)")
    return {k: kept.get(k) for k in names}


def _json_line(path: str, n: int, line: str | bytes) -> dict:
    """Line `n` parsed (bytes: a large line, its long id arrays as numpy arrays: large_lines)."""
    try:
        obj = json.loads(line) if isinstance(line, str) else loads_large(line, json.loads)
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: line {n} is not UTF-8 (byte {e.start + 1}: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: line {n} is not JSON ({e.msg})") from None
    except RecursionError:
        raise DatasetError(f"{path}: line {n} is not JSON zorro reads (nested too deep)") from None
    except ValueError as e:  # Python's limit on the digits of an integer
        raise DatasetError(f"{path}: line {n} is not JSON zorro reads ({e})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}: line {n} is not a JSON object")
    return obj


def _compact(v: Any) -> Any:
    """A list of int64-range ints as an int64 array (8 bytes an id instead of a Python int's ~36);
    anything else as it is (checked, with its row, when its column is used)."""
    if isinstance(v, list) and v and set(map(type, v)) == {int} and -(2**63) <= min(v) and max(v) < 2**63:
        return np.array(v, dtype=np.int64)
    return v


def _values(col) -> list:
    return col.to_pylist() if hasattr(col, "to_pylist") else list(col)


def _pick(path: str, columns: dict, given: Optional[str], candidates: Sequence[str], what: str) -> Optional[str]:
    if given is not None:
        if given not in columns:
            raise DatasetError(f"{path}: no column {given!r} (columns: {', '.join(columns)})")
        return given
    return next((c for c in candidates if c in columns), None)


def _is_arrow(col: Any) -> bool:
    return hasattr(col, "type") and hasattr(col, "combine_chunks")


def _arrow_int_lists(col: Any) -> bool:
    import pyarrow as pa

    t = col.type
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _row_kind(v: Any) -> str:
    """What one row's value is: token_ids, text, chat, or a description of what it is instead."""
    if isinstance(v, str):
        return "text"
    if isinstance(v, np.ndarray):
        return "token_ids"
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(m, dict) for m in v):
            return "chat"
        if v and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in v):
            return "token_ids"
        return f"a list of {', '.join(sorted({type(x).__name__ for x in v})) or 'nothing'}"
    return type(v).__name__


def _value_kind(path: str, column: str, values: Any) -> str:
    """token_ids, text or chat, from the column's first row (every row is checked by _check_rows)."""
    if _is_arrow(values):
        if _arrow_int_lists(values):
            return "token_ids"
        values = values.slice(0, 1).to_pylist()
    v = values[0]
    if v is None:
        raise DatasetError(f"{path}: column {column!r} is empty in row 0")
    kind = _row_kind(v)
    if kind in ("token_ids", "text", "chat"):
        return kind
    if isinstance(v, (list, tuple)) and not v:
        raise DatasetError(f"{path}: column {column!r} row 0 is an empty list")
    raise DatasetError(
        f"{path}: column {column!r} holds neither text, chat messages ({{role, content}}) nor token ids (row 0: {kind})"
    )


def _bad_id(v: list) -> Optional[str]:
    """Why a list is not token ids (its first bad element), or None."""
    for x in v:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            return f"holds {type(x).__name__} {x!r}, not an integer token id"
        if not 0 <= x < 2**63:
            return f"holds token id {int(x)}" + (", negative" if x < 0 else ", beyond int64")
    return None


def _check_rows(path: str, column: str, values: list, kind: str) -> None:
    """Every row of `column` holds a `kind` value; else the first row that does not, with what it holds."""
    for i, v in enumerate(values):
        where = f"{path}: row {i} of column {column!r}"
        if v is None:
            missing = sum(x is None for x in values)
            raise DatasetError(f"{path}: column {column!r} is empty in {missing} row(s) (first: row {i})")
        got = _row_kind(v)
        if kind == "token_ids" and isinstance(v, (list, tuple)):
            if not v:
                raise DatasetError(f"{where} is an empty list")
            why = _bad_id(list(v))
            if why:
                raise DatasetError(f"{where} {why}")
        elif kind == "chat" and got == "chat":
            bad = next((m for m in v if "role" not in m or "content" not in m), None)
            if bad is not None:
                raise DatasetError(f"{where} holds a message without role and content ({sorted(bad)})")
        elif got != kind:
            raise DatasetError(f"{where} holds {got}, not {kind.replace('_', ' ')} like row 0")


# -- tokenizers ------------------------------------------------------------------------------------


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
            template = chat_template or _sibling_template(path, self.specials)
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
            if len(self.chat_template) > MAX_TEMPLATE_CHARS:
                raise DatasetError(
                    f"{name}: {len(self.chat_template):,} characters, over the {MAX_TEMPLATE_CHARS:,} zorro compiles"
                )
            if _COMPILE_TEMPLATE is None:
                raise DatasetError(f"{name}: {_NO_TEMPLATE_COMPILER}")
            try:
                self._compiled = _COMPILE_TEMPLATE(self.chat_template)
            except Exception as e:
                raise DatasetError(f"{name}: the chat template does not compile ({type(e).__name__}: {e})") from e
        extra = {k: v for k, v in self.specials.items() if v is not None}
        out = []
        for i, c in enumerate(conversations):
            try:
                out.append(
                    _render_limited(
                        self._compiled, name, messages=c, add_generation_prompt=add_generation_prompt, **extra
                    )
                )
            except DatasetError as e:
                raise DatasetError(f"{e} (rendering row {i} of {data_path})") from None
            except Exception as e:
                raise DatasetError(f"{data_path}: {name} fails on row {i} ({type(e).__name__}: {e})") from e
        return out


class _TimedRange:
    """The sandbox's range, checking the rendering's deadline as it is iterated: a template's loops
    are its only unbounded work (the sandbox caps each range's length, not their nesting)."""

    def __init__(self, r: range, deadline: float, name: str) -> None:
        self.r, self.deadline, self.name = r, deadline, name

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i: Any) -> Any:
        return self.r[i]

    def __iter__(self):
        deadline = self.deadline
        for i, x in enumerate(self.r):
            if not i & 1023 and time.monotonic() > deadline:
                raise DatasetError(f"{self.name}: rendering one row took over {RENDER_SECONDS:g} seconds (a loop?)")
            yield x


def _render_limited(compiled: Any, name: str, **variables: Any) -> str:
    """compiled.render(**variables), stopped past RENDER_SECONDS or MAX_RENDER_CHARS characters."""
    from jinja2.sandbox import safe_range

    deadline = time.monotonic() + RENDER_SECONDS

    def timed_range(*args: int) -> _TimedRange:
        if time.monotonic() > deadline:
            raise DatasetError(f"{name}: rendering one row took over {RENDER_SECONDS:g} seconds (a loop?)")
        return _TimedRange(safe_range(*args), deadline, name)

    parts, size = [], 0
    for chunk in compiled.generate(range=timed_range, **variables):
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise DatasetError(f"{name}: one row renders to over {MAX_RENDER_CHARS:,} characters")
        if time.monotonic() > deadline:
            raise DatasetError(f"{name}: rendering one row took over {RENDER_SECONDS:g} seconds (a loop?)")
        parts.append(chunk)
    return "".join(parts)


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


def _ids_column(path: str, column: str, values: Any) -> Ragged:
    """A token-id column as a Ragged, every row checked (integers in [0, 2**63), none empty)."""
    if _is_arrow(values):
        ids = _arrow_ids(path, column, values)
    else:
        _check_rows(path, column, values, "token_ids")
        ids = Ragged.from_lists([v if isinstance(v, np.ndarray) else np.asarray(list(v), np.int64) for v in values])
    neg = np.flatnonzero(ids.flat < 0)
    if neg.size:
        row = int(np.searchsorted(ids.offsets, neg[0], side="right")) - 1
        raise DatasetError(f"{path}: row {row} of column {column!r} holds token id {int(ids.flat[neg[0]])}, negative")
    return ids


def _arrow_ids(path: str, column: str, col: Any) -> Ragged:
    """A parquet list<integer> column, checked and flattened in arrow (no Python objects per id)."""
    if not _arrow_int_lists(col):
        raise DatasetError(f"{path}: column {column!r} holds {col.type}, not lists of integer token ids")
    arr = col.combine_chunks()
    if arr.null_count:
        row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise DatasetError(f"{path}: column {column!r} is empty in {arr.null_count} row(s) (first: row {row})")
    offsets = arr.offsets.to_numpy().astype(np.int64)
    offsets = offsets - offsets[0]
    values = arr.flatten()
    if values.null_count:
        at = int(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0])
        row = int(np.searchsorted(offsets, at, side="right")) - 1
        raise DatasetError(f"{path}: row {row} of column {column!r} holds a null token id")
    flat = values.to_numpy()
    empty = np.flatnonzero(np.diff(offsets) == 0)
    if empty.size:
        raise DatasetError(f"{path}: row {int(empty[0])} of column {column!r} is an empty list")
    if flat.dtype == np.uint64 and flat.size and int(flat.max()) >= 2**63:
        at = int(np.argmax(flat >= 2**63))
        row = int(np.searchsorted(offsets, at, side="right")) - 1
        raise DatasetError(f"{path}: row {row} of column {column!r} holds token id {int(flat[at])}, beyond int64")
    return Ragged(flat.astype(np.int64), offsets)


def check_vocab(path: str, column: str, ids: Ragged, vocab_size: int) -> None:
    """Refuse a token id >= vocab_size, naming its row and value."""
    over = np.flatnonzero(ids.flat >= vocab_size)
    if over.size:
        row = int(np.searchsorted(ids.offsets, over[0], side="right")) - 1
        raise DatasetError(
            f"{path}: row {row} of column {column!r} holds token id {int(ids.flat[over[0]])}, "
            f"outside the model's vocabulary ({vocab_size} ids)"
        )


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
) -> TokenizedData:
    """Read `path` and tokenize its prompts (and completions: "all", or "sample" for a random
    COMPLETION_SAMPLE of them, enough for their length distribution); see the module docstring.
    Every row is checked; with `vocab_size`, every token id against it. `chat_template_name` names
    `chat_template` in errors (its file)."""
    if completions not in ("all", "sample"):
        raise ValueError(f"completions must be 'all' or 'sample', got {completions!r}")
    fmt, columns = read_columns(path, COLUMNS_READ | {c for c in (prompt_column, completion_column) if c})
    pcol = _pick(path, columns, prompt_column, PROMPT_ID_COLUMNS + PROMPT_COLUMNS, "prompt")
    if pcol is None:
        raise DatasetError(
            f"{path}: no prompt column (looked for {', '.join(PROMPT_ID_COLUMNS + PROMPT_COLUMNS)}; "
            f"columns: {', '.join(columns)}; give --prompt-column)"
        )
    pcolumn = columns[pcol]
    kind = _value_kind(path, pcol, pcolumn)
    ccol = _pick(
        path,
        columns,
        completion_column,
        COMPLETION_ID_COLUMNS if kind == "token_ids" else COMPLETION_COLUMNS,
        "completion",
    )
    if kind == "token_ids":
        prompts = _ids_column(path, pcol, pcolumn)
        ids = None
        if ccol is not None:
            if _value_kind(path, ccol, columns[ccol]) != "token_ids":
                raise DatasetError(f"{path}: prompt column {pcol!r} holds token ids but {ccol!r} does not")
            ids = _ids_column(path, ccol, columns[ccol])
        data = TokenizedData(path, fmt, kind, pcol, ccol, prompts, ids)
        _check_data_vocab(data, vocab_size)
        return data
    pvals = _values(pcolumn)
    _check_rows(path, pcol, pvals, kind)
    cvals = _values(columns[ccol]) if ccol else None
    if tokenizer is None:
        raise DatasetError(f"{path}: column {pcol!r} holds {kind}, not token ids: give --tokenizer PATH (local)")
    tok = LocalTokenizer(tokenizer, chat_template, chat_template_name)
    if kind == "chat" and pcol == "messages" and ccol is None:
        pvals, cvals = _split_messages(path, pvals)
        ccol = "messages"
    elif cvals is not None:
        ckind = _value_kind(path, ccol, cvals)  # type: ignore[arg-type]
        if ckind != "text" and not (kind == "chat" and ckind == "chat"):
            raise DatasetError(f"{path}: prompt column {pcol!r} holds {kind} but {ccol!r} holds {ckind}")
        _check_rows(path, ccol, cvals, ckind)  # type: ignore[arg-type]
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
        return data
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
