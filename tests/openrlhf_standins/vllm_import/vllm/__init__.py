"""Test-only import stand-in for vLLM (tests/openrlhf_standins/README.md): `openrlhf.trainer.ray` imports vLLM
at module level; the Ray tests build OpenRLHF's model actors and never generate. Every name raises when used."""

__version__ = "0.0.0+zorro-test-standin"


def _unavailable(*args, **kwargs):
    raise RuntimeError("vLLM is a test-only import stand-in here (tests/openrlhf_standins/README.md)")


SamplingParams = LLM = _unavailable
