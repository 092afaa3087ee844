"""The sharing modes a plan is built with, and the check of a mode and its `min_shared_tokens`."""

from __future__ import annotations

SHARINGS = ("prompt", "prefix")
DEFAULT_MIN_SHARED_TOKENS = 16
"""Default `min_shared_tokens` (see the README's prefix-sharing measurement)."""


def check_sharing(sharing: str, min_shared_tokens: int) -> None:
    if sharing not in SHARINGS:
        raise ValueError(f"unknown sharing {sharing!r}; choose one of {SHARINGS}")
    if isinstance(min_shared_tokens, bool) or not isinstance(min_shared_tokens, int) or min_shared_tokens < 1:
        raise ValueError(f"min_shared_tokens must be an int >= 1, got {min_shared_tokens!r}")
