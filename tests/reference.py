"""The independent per-sequence reference, now in zorro_core.verify.reference (kept importable as before)."""

from zorro_core.verify.reference import (  # noqa: F401
    actor_run,
    loss_of,
    max_abs_error,
    max_rel_grad_error,
    per_sequence,
    rel_grad_errors,
    sequence_forward,
    token_weights,
)
