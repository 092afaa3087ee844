import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# Tiny shapes run faster on one thread, and two OpenMP threads spin-wait badly on a shared,
# loaded 2-core machine (measured: ~2.5 s vs 0.02 s per new sequence length at load 6).
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
    from reference import per_sequence, token_weights

    cache = {}

    def get(key, model, make_batch, temperature: float, seed: int):
        if key not in cache:
            batch = make_batch()
            w = token_weights(batch, seed=seed)
            cache[key] = (batch, w, per_sequence(model(), batch, temperature, w))
        return cache[key]

    return get
