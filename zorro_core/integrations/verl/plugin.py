"""verl's trainer registration and vLLM's CPU plugin, by their old path.

The entry points now name the tiny `zorro_plugins` package (zorro_plugins.verl, zorro_plugins.vllm),
which imports nothing of zorro until there is work to do; this module re-exports the same objects
(one after-import finder whichever path installs it) for code that imports them from here:
`after_import` (used by `cpu`), `install`, `register_trainer_name`, `vllm_cpu_plugin`, `TRIGGER`.
Importing it installs the watcher, as before.
"""

from __future__ import annotations

from zorro_plugins.hooks import AfterImport as _AfterImport
from zorro_plugins.hooks import after_import
from zorro_plugins.verl import TRIGGER, install, register_trainer_name
from zorro_plugins.vllm import cpu_platform as vllm_cpu_plugin

__all__ = ["TRIGGER", "after_import", "install", "register_trainer_name", "vllm_cpu_plugin", "_AfterImport"]

install()
