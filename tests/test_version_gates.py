"""Below the release a family needs, the actor refuses it rather than computing it wrong (tests/versions.py)."""

import pytest
from helpers import mixed_batch
from versions import QWEN3_NEXT_ADAPTABLE, QWEN3_NEXT_MIN

from zorro_core import DeduplicatedActor


@pytest.mark.skipif(QWEN3_NEXT_ADAPTABLE, reason=f"transformers >= {QWEN3_NEXT_MIN}: the adapter serves Qwen3-Next")
def test_qwen3_next_refused_below_its_transformers(tiny_models):
    with pytest.raises(RuntimeError, match="linear_attention': 0"):
        DeduplicatedActor(model=tiny_models("tiny-qwen3-next")).forward(mixed_batch())
