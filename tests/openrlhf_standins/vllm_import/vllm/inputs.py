"""Test-only import stand-in (see the package's doc)."""

from vllm import _unavailable as TokensPrompt  # noqa: F401
