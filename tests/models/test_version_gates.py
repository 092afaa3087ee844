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


@pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=f"transformers < {QWEN3_NEXT_MIN}: refused by the test above")
@pytest.mark.parametrize("family", ["tiny-qwen3-next", "tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_gated_deltanet_refused_above_the_tested_releases(tiny_models, monkeypatch, family):
    """A transformers release past the newest the adapter follows (5.25) is refused with the reason,
    for the gated DeltaNet families only: the others are still served (pyproject caps the range too)."""
    from zorro_core.models import linear_attention

    # the transformers module the adapter reads (a test elsewhere in the session may re-import it)
    monkeypatch.setattr(linear_attention.transformers, "__version__", "5.26.0")
    model = tiny_models(family)
    linear_attention.uninstall_linear_attention(model)  # a fresh actor installs (and checks) the layers again
    with pytest.raises(UnsupportedModelError, match=r"tested up to 5\.25"):
        DeduplicatedActor(model=model).forward(mixed_batch())
    if family == "tiny-qwen3.5-moe":  # the last case: a family without such layers is still served
        DeduplicatedActor(model=tiny_models("tiny-qwen3")).forward(mixed_batch())
