"""zorro's CPU test platform for verl's trainer (`zorro_core.integrations.verl.cpu`), against the real
verl 0.9.1 (its own venv: `.ci/verl_tests`, which has no vLLM: the module must import without it).

- Each workaround is still needed by the installed verl and torch (`needed()`): a probe that fails
  when upstream answers one, so that it is removed.
- Each answers what it is for: the backend string, the device module's functions, the unpinned
  offload policy, verl's FSDP engines for device "cpu".
- `VERL_PLATFORM=cpu` plus `VERL_USE_EXTERNAL_MODULES` (`CPU_ENV`) select and load it in a fresh
  process (as in every Ray worker); without them nothing of it loads, and vLLM's plugin entry point
  returns without importing anything.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_tests for the verl suite)")


def _fresh(code: str, env: dict[str, str]) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_MODULES")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=full)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_imports_without_vllm_and_every_workaround_is_still_needed():
    from zorro_core.integrations.verl import cpu as verl_cpu

    if "vllm" not in sys.modules:
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    needed = verl_cpu.needed()
    assert set(needed) == set(verl_cpu.WORKAROUNDS)
    fixed = [name for name, still in needed.items() if not still]
    assert not fixed, f"verl {verl.__version__} / torch answer {fixed} themselves now: remove those workarounds"


def test_device_module_answers_what_verl_calls():
    import torch

    from zorro_core.integrations.verl import cpu as verl_cpu

    device = verl_cpu.cpu_device_module()
    for name in verl_cpu._DEVICE_NAMES:
        assert callable(getattr(device, name)), name
    assert device.memory_allocated() == 0 and device.max_memory_reserved() == 0
    free, total = device.mem_get_info()
    assert 0 < free <= total
    state = device.get_rng_state()
    a = torch.rand(3)
    device.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    assert device.current_stream() is not None  # torch.cpu's own
    assert device.synchronize is torch.cpu.synchronize


def test_workarounds_on_the_cpu_platform(monkeypatch):
    import verl.utils.distributed as distributed
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    from zorro_core.integrations.verl import cpu as verl_cpu

    verl_cpu.use_cpu_platform()
    assert verl_cpu.on_cpu_platform()
    platform = verl.plugin.platform.get_platform()
    assert platform.is_ipc_supported() is False  # verl's weight sync uses shared memory
    assert platform.device_name == "cpu" and platform.communication_backend_name() == "gloo"

    calls = []

    def fake(timeout_second=None, backend=None):
        calls.append(backend)

    # Rebuild the wrapper around a recorder: the same code path verl's worker takes.
    monkeypatch.setattr(distributed, "initialize_global_process_group_ray", fake)
    verl_cpu._cpu_backend()
    distributed.initialize_global_process_group_ray(timeout_second=None)
    distributed.initialize_global_process_group_ray(backend="cpu:gloo")
    assert calls == ["cpu:gloo", "cpu:gloo"], calls

    policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False

    for backend in ("fsdp", "fsdp2"):
        keys = EngineRegistry._engines["language_model"][backend]
        assert keys["cpu"] is keys["cuda"], keys


def test_selected_in_a_fresh_process_only_when_named():
    from zorro_core.integrations.verl.cpu import CPU_ENV

    code = (
        "import sys, verl\n"
        "from verl.plugin.platform import get_platform\n"
        "from verl.utils.distributed import initialize_global_process_group_ray as f\n"
        "print(type(get_platform()).__name__, getattr(f, '_zorro_cpu', False),\n"
        "      'zorro_core.integrations.verl.cpu' in sys.modules, 'zorro_core.integrations.verl.cpu_vllm' in sys.modules)\n"
    )
    env = dict(CPU_ENV, VERL_USE_EXTERNAL_MODULES="zorro_core.integrations.verl.cpu")  # no vLLM in this venv
    assert _fresh(code, env).split() == ["PlatformCPU", "True", "True", "False"]
    # A job that names nothing (a GPU run): nothing of the CPU platform loads.
    plain = _fresh(code, {})
    assert plain.split()[1:] == ["False", "False", "False"], plain
    # vLLM's plugin entry point: returns at once unless VERL_PLATFORM=cpu.
    plugin = (
        "import sys\n"
        "from zorro_core.integrations.verl.plugin import vllm_cpu_plugin\n"
        "vllm_cpu_plugin()\n"
        "print('zorro_core.integrations.verl.cpu_vllm' in sys.modules, 'vllm' in sys.modules)\n"
    )
    assert _fresh(plugin, {}).split() == ["False", "False"]
