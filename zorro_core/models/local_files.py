"""Reading models and tokenizers from local files only: no code from the files, no network.

- No code from data: a model or tokenizer directory whose config.json or tokenizer_config.json
  has an `auto_map` names Python files of its own that transformers would import (after asking
  "run the custom code? [y/N]" on a terminal, where one "y" runs them). zorro refuses such a
  directory before transformers sees it (refuse_remote_code), and passes
  `trust_remote_code=False` to every loader as well. There is no opt-in: the model families
  zorro supports are those transformers implements (zorro_core.models.registry).
- No network: `local_files_only=True` alone still lets huggingface_hub make requests of its own
  (an agent registry fetched on first use), so every loader runs inside hub_offline(), which
  turns the hub's offline switch on for the duration of the call; a name not in the local cache
  is refused at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any, Iterator, Optional

CODE_FILES = ("config.json", "tokenizer_config.json")
"""The files of a directory whose `auto_map` makes transformers import the directory's Python."""

_lock = threading.Lock()
_depth = 0
_saved: tuple[Any, Optional[str]] = (None, None)


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Within: huggingface_hub offline (its constant, read at call time, and HF_HUB_OFFLINE in the
    environment); on exit the previous state is put back. Nests, and is safe across threads (the
    outermost exit restores)."""
    global _depth, _saved
    import huggingface_hub.constants as hub

    with _lock:
        if _depth == 0:
            _saved = (hub.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
            hub.HF_HUB_OFFLINE = True
            os.environ["HF_HUB_OFFLINE"] = "1"
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                flag, env = _saved
                hub.HF_HUB_OFFLINE = flag
                if env is None:
                    os.environ.pop("HF_HUB_OFFLINE", None)
                else:
                    os.environ["HF_HUB_OFFLINE"] = env


def refuse_remote_code(directory: str, what: str = "model") -> None:
    """ValueError naming the file and the key when `directory` holds a config that points
    transformers at Python code of its own (`auto_map`). A file that cannot be read as a JSON table
    is left to transformers, which reports it (and runs no code from it)."""
    for name in CODE_FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(data, dict) and "auto_map" in data:
            auto_map = data["auto_map"]
            names = ", ".join(map(str, auto_map)) if isinstance(auto_map, (dict, list)) else repr(auto_map)
            raise ValueError(
                f"{what} {directory!r}: {path} has the key 'auto_map' ({names}), which makes transformers run "
                "Python code from the directory; zorro never runs code from a model or tokenizer directory "
                "(trust_remote_code=False). Use a checkpoint of a family transformers implements"
            )


def hub_cache_path(name: str) -> Optional[str]:
    """The directory of `name` in the local Hugging Face cache (offline); None when it is not there."""
    from huggingface_hub import snapshot_download

    try:
        with hub_offline():
            return snapshot_download(name, local_files_only=True)
    except Exception:
        return None


def local_checkpoint(name_or_path: str, what: str = "model") -> Optional[str]:
    """The local directory of `name_or_path` (a directory, or a name in the local cache), checked
    by refuse_remote_code; None when there is none."""
    path = name_or_path if os.path.isdir(name_or_path) else hub_cache_path(name_or_path)
    if path is not None:
        refuse_remote_code(path, what)
    return path
