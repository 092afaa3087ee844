"""scripts/region_calls_check.py on the CPU, torch's aten pair over the kernels' emulation: every
region call kind runs and is timed, zorro makes no host sync per layer (only the first layer's call
of a forward builds its layout), nothing is compiled, the schedule's self-check passes; and a run
past its deadline ends 124 with every thread's stack."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "region_calls_check.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SMALL = ["--device", "cpu", "--emulate", "--prompt-len", "24", "--response-len", "4", "--group-size", "4"]


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *SMALL, *args], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def test_region_calls_timed_without_a_sync_per_layer(tmp_path):
    out = tmp_path / "r.json"
    res = _run("--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["backend"] == "torch_varlen" and d["verdict"]["passed"]
    assert set(d["calls"]) == {"capture forward", "attend forward", "attend backward", "capture backward"}
    layers = 2  # tiny-qwen3
    for name, step in d["steps"].items():
        rows = [r for r in d["rows"] if r["step"].startswith(f"step {name} ")]
        attend = [r for r in rows if r["kind"] == "attend forward"]
        assert len(attend) == layers * step["micro_batches"]
        # the layout is built by each forward's first attention layer; the other layers reuse it
        assert [r["syncs"] > 0 for r in attend] == [True, False] * step["micro_batches"]
        assert all(r["syncs"] == 0 for r in rows if r["kind"].endswith("backward"))
    assert d["dynamo_frames_compiled"] == 0


def test_a_run_past_its_deadline_dumps_the_stacks(tmp_path):
    res = _run("--timeout-s", "1", "--out", str(tmp_path / "r.json"))
    assert res.returncode == 124, res.stdout[-2000:] + res.stderr[-2000:]
    assert "TIMEOUT: the run passed 1 s" in res.stdout
    assert "most recent call first" in res.stderr and "  File " in res.stderr  # every thread's stack
    assert not (tmp_path / "r.json").exists()


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("region_calls_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cuda_sync_warnings_are_counted_nested_and_others_shown(monkeypatch):
    """On CUDA the syncs are torch's sync-debug warnings: counted in the innermost block and the outer
    one, the script's own synchronize not counted, any other warning still shown."""
    import warnings

    import torch

    mod = _script()
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    syncs = mod.Syncs(cuda=True)
    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda *a, **kw: shown.append(str(a[0])))
    with syncs.counting():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=2)
        with syncs.counting():
            warnings.warn("called a synchronizing CUDA operation", stacklevel=2)
            warnings.warn("called a synchronizing CUDA operation", stacklevel=2)
            with syncs.pausing():
                warnings.warn("called a synchronizing CUDA operation", stacklevel=2)
            warnings.warn("something else", stacklevel=2)
        inner = syncs.last
        warnings.warn("called a synchronizing CUDA operation", stacklevel=2)
    assert (inner, syncs.last, syncs.count) == (2, 4, 4)
    assert shown == ["something else"]
