"""Test-only import stand-in (see the package's doc)."""

from vllm import _unavailable as random_uuid  # noqa: F401
