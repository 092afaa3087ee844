"""Imported by the Megatron engine and its CPU module before any of megatron's names: a missing
megatron-core or mbridge is refused with the install command (verl declares neither)."""

from __future__ import annotations

import importlib.util

MEGATRON_INSTALL = "pip install megatron-core==0.16.1 mbridge==0.15.1 einops"
"""The tested releases beside verl 0.9.1 (mbridge imports einops without declaring it)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


for _module, _name in (("megatron.core", "megatron-core"), ("mbridge", "mbridge")):
    if not _installed(_module):
        raise ModuleNotFoundError(
            f"zorro's verl Megatron engine (zorro_core.integrations.verl.megatron_engine) needs {_name}, "
            f"which is not installed: {MEGATRON_INSTALL}",
            name=_module,
        )
