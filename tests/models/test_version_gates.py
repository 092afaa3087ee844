"""Below the release a family needs, the actor refuses it rather than computing it wrong (tests/versions.py)."""

import pytest
from helpers import mixed_batch
from versions import QWEN3_NEXT_ADAPTABLE, QWEN3_NEXT_MIN

from zorro_core import DeduplicatedActor
from zorro_core.errors import UnsupportedModelError


@pytest.mark.skipif(QWEN3_NEXT_ADAPTABLE, reason=f"transformers >= {QWEN3_NEXT_MIN}: the adapter serves Qwen3-Next")
def test_qwen3_next_refused_below_its_transformers(tiny_models):
    with pytest.raises((RuntimeError, UnsupportedModelError), match="linear_attention': 0|gated DeltaNet"):
        DeduplicatedActor(model=tiny_models("tiny-qwen3-next")).forward(mixed_batch())


@pytest.mark.skipif(QWEN3_NEXT_ADAPTABLE, reason=f"transformers >= {QWEN3_NEXT_MIN}: the adapter serves Qwen3.5")
@pytest.mark.parametrize("family", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_qwen3_5_refused_below_its_transformers(tiny_models, family):
    """Below 5.15 the layer calls the kernels it bound (and the module may lack causal_conv1d_fn):
    refused when the adapter is installed or by the call count, never computed."""
    with pytest.raises((RuntimeError, UnsupportedModelError), match="linear_attention': 0|gated DeltaNet"):
        DeduplicatedActor(model=tiny_models(family)).forward(mixed_batch())
