import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# The shared helpers (helpers.py, versions.py, ...) live here; tests in one layer's folder also import
# pieces of another test module (`from test_checkpointing import checkpointing`), so each folder that
# holds tests is on the path too. Not tests/integrations itself: its sub-folders are named like the
# trainers (trl/, verl/, openrlhf/) and would shadow a trainer that is not installed.
for folder in [HERE] + sorted(
    root
    for root, _, files in os.walk(HERE)
    if root != os.path.join(HERE, "integrations") and any(f.startswith("test_") and f.endswith(".py") for f in files)
):
    if folder not in sys.path:
        sys.path.insert(0, folder)
# Tiny shapes run faster on one thread, and two OpenMP threads spin-wait badly when other
# processes share the cores (~2.5 s vs 0.02 s per new sequence length on 2 busy cores).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models():
    """float64 tiny models of each family, eager attention, random weights (built once)."""
    from zorro_core.models.presets import build_model, preset_config

    cache = {}

    def get(name: str, **overrides):
        key = (name, tuple(sorted(overrides.items())))
        if key not in cache:
            cache[key] = build_model(
                preset_config(name, **overrides), dtype=torch.float64, attn_implementation="eager", seed=0
            )
        return cache[key]

    return get


@pytest.fixture(scope="module")
def per_sequence_reference():
    """get(key, model, make_batch, temperature, seed) -> (batch, weights, (log-probs, entropy, grads)):
    the independent per-sequence reference of `model()` on `make_batch()`, computed once per key
    within a test module (keys need only be unique there)."""
    from zorro_core.verify.reference import per_sequence, token_weights

    cache = {}

    def get(key, model, make_batch, temperature: float, seed: int):
        if key not in cache:
            batch = make_batch()
            w = token_weights(batch, seed=seed)
            cache[key] = (batch, w, per_sequence(model(), batch, temperature, w))
        return cache[key]

    return get


# ---------------------------------------------------------------- a sweep whose cases are faked

SUITE = """
name = "fake"
[measure]
repeats = 3
warmup = 0
memory = false
phases = ["forward"]
[defaults]
model = "tiny-qwen3"
batch_size = 4
prompt_len = 8
response_len = 2
[[grid]]
num_unique_prompts = [1, 2, 4]
"""


def fake_case_rows(case, measure, fault=None, on_phase=None, max_memory=None):
    """What runner.case_rows reports, without running anything."""
    from zorro_harness.bench.results import COLUMNS

    rows = []
    for p in measure.phases:
        r = {c: "" for c in COLUMNS}
        r.update(case_id=case.case_id, phase=p, model=case.model, status="ok", speedup=2.0, ideal_speedup=3.0)
        on_phase(r)
        rows.append(r)
    return rows


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """A suite file whose cases are faked (zorro_harness.bench.sweep.case_rows), and a sweep runner."""
    from typer.testing import CliRunner

    import zorro_harness.bench.sweep as sweep_mod
    from zorro_cli.main import app

    runner = CliRunner()
    monkeypatch.setattr(sweep_mod, "case_rows", fake_case_rows)
    suite = tmp_path / "s.toml"
    suite.write_text(SUITE)

    def run(*args):
        return runner.invoke(app, ["bench", "sweep", str(suite), *map(str, args)])

    run.suite = suite
    return run


@pytest.fixture
def kernel_emulation():
    """The CUDA varlen kernels' CPU emulation (tests/kernel_emulation): `.flash_attn(version)` loads
    flash-attn's real interface at a release over it, `.aten()` registers torch's aten flash ops on
    CPU; both undone after the test."""
    import contextlib

    from tests.kernel_emulation.releases import Emulation

    with contextlib.ExitStack() as stack:
        yield Emulation(stack)
