"""The actors refuse a temperature that is not a finite number > 0 and a model moved or cast after
they were built, instead of computing something else without a word."""

import math

import pytest
import torch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.models.presets import load_model


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-qwen3", dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def batch():
    return create_dummy_batch(batch_size=4, num_unique_prompts=2, prompt_len=6, response_len=3, vocab_size=256)


ACTORS = [lambda m: DeduplicatedActor(model=m), lambda m: BaselineActor(model=m),
          lambda m: BaselineActor(model=m, padded=True)]  # fmt: skip


@pytest.mark.parametrize("make", ACTORS, ids=["dedup", "baseline", "padded"])
# A string or bool passes float(): "1.0" would fail deep in the log-probs instead of here.
@pytest.mark.parametrize(
    "temperature", [math.inf, -math.inf, math.nan, 0.0, -0.7, "hot", None, "1.0", b"1", True, [1.0]]
)
def test_temperature_must_be_finite_and_positive(model, batch, make, temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        make(model).forward(batch, temperature=temperature)


@pytest.mark.parametrize("make", ACTORS, ids=["dedup", "baseline", "padded"])
def test_a_model_cast_after_the_actor_was_built_is_refused(batch, make):
    m = load_model("tiny-qwen3", dtype=torch.float32, attn_implementation="sdpa").eval()
    actor = make(m)
    assert actor.forward(batch, temperature=0.7).log_probs.dtype == torch.float32  # works as built
    m.to(torch.float64)
    with pytest.raises(
        ValueError, match=r"moved or cast after the actor was built \(cpu, torch.float32 -> cpu, torch.float64\)"
    ):
        actor.forward(batch)
    m.to(torch.float32)
    actor.forward(batch)  # back as built: fine again
