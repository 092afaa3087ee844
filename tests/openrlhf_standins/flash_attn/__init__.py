"""Test-only stand-in for flash-attn (CUDA-only): see tests/openrlhf_standins/README.md."""

__version__ = "0.0.0+zorro-test-standin"
