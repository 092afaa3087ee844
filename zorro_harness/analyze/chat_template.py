"""Chat templates rendered as the tokenizer's would be, within limits: transformers' own sandboxed
compiler (probed once), a bounded time and output per row, and a tokenizer.json's template beside it."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional

from zorro_harness.analyze.readers import DatasetError

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

RENDER_SECONDS = 10.0
"""The longest one row's chat-template rendering may take (a template's loops are otherwise unbounded)."""
MAX_RENDER_CHARS = 64 * 2**20
"""The longest text one row's chat-template rendering may produce."""
MAX_TEMPLATE_CHARS = 2**20
"""The longest chat template compiled (real ones are a few KB; compiling takes memory in proportion)."""


def compile_template(template: str, name: str) -> Any:
    """`template` compiled by transformers' compiler (`name` names it in errors), within MAX_TEMPLATE_CHARS."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise DatasetError(f"{name}: {len(template):,} characters, over the {MAX_TEMPLATE_CHARS:,} zorro compiles")
    if _COMPILE_TEMPLATE is None:
        raise DatasetError(f"{name}: {_NO_TEMPLATE_COMPILER}")
    try:
        return _COMPILE_TEMPLATE(template)
    except Exception as e:
        raise DatasetError(f"{name}: the chat template does not compile ({type(e).__name__}: {e})") from e


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


def render_limited(compiled: Any, name: str, **variables: Any) -> str:
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


def sibling_template(path: str, specials: dict) -> Optional[str]:
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
