"""The error every room raises when it refuses a model or a feature (fail closed, with the reason)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model, or a feature it uses, cannot be run by the dedup path without changing the result."""
