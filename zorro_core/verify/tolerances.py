"""The tolerances of the proofs, defined once: `zorro verify`, the test suite and the trainer
integrations' tests compare against the float64 per-sequence reference with these.

Measured float64 floor: transformers keeps RMSNorm, RoPE and eager softmax in float32 even in a
float64 model, so the reference itself carries noise (observed: log-probs ~6e-8 absolute,
gradients ~6e-7 relative). The floors sit an order above it; a wrong mask, position or label is
off by > 1e-2 (tests/actor/test_actor.py::test_bugs_fail_by_orders_of_magnitude).
"""

from __future__ import annotations

LOGPROB_ATOL = 1e-6
"""float64: the largest |log-prob - ref64| and |entropy - ref64| on any token."""
GRAD_RTOL = 1e-5
"""float64: the largest ||grad - ref64|| / ||ref64|| of any parameter."""
AUX_RTOL = 1e-7
"""float64: the largest |aux loss - ref64| / ref64 of an MoE router aux loss (transformers computes the
router softmax in float32 whatever the dtype; measured <= 1e-9 relative)."""
LOW_PRECISION_FACTOR = 4.0
"""float32/bfloat16: dedup's error against ref64 may be this many times the baseline actor's
(the dtype's own noise), plus the float64 floor above."""
TRAINER_FLOAT32_RTOL = 1e-4
"""float32, a trainer run twice on the same weights and rollout (verl's main_ppo, plain and with
zorro: examples/verl/cpu_e2e.py): the largest relative difference of a step's aggregated metrics
(entropy, losses, grad norm), two computation orders of the same sums; observed <= 2.5e-7."""
TRAINER_FLOAT32_ATOL = 1e-6
"""The same comparison's absolute floor, for metrics that are ~0 (a batch's mean advantage ~1e-8,
rollout-vs-actor probability differences ~1e-9)."""
