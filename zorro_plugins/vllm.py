"""vLLM's general plugin entry point (group "vllm.general_plugins", run in every vLLM process)."""

from __future__ import annotations

import importlib
import os


def cpu_platform() -> None:
    """On zorro's CPU test platform for verl (`VERL_PLATFORM=cpu`) load
    `zorro_core.integrations.verl.cpu_vllm`; otherwise return at once, importing nothing."""
    if os.environ.get("VERL_PLATFORM", "").strip().lower() != "cpu":
        return
    importlib.import_module("zorro_core.integrations.verl.cpu_vllm")
