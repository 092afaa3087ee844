"""`verify training` with settings that make training diverge (a learning rate of 1e30): the
non-finite loss or weights are reported as such, naming the step and the run, as an error of the
settings, not as a dedup failure "drift nan > nan"."""

import math

from zorro_core.verify.training import TrainConfig, verify_training


def test_a_diverging_run_is_reported_as_non_finite_naming_the_step():
    res = verify_training(TrainConfig(model="tiny-qwen3", lr=1e30, steps=3, num_batches=1))
    assert res.status == "error", (res.status, res.reason)
    assert "nan >" not in res.reason and "not finite" in res.reason, res.reason
    assert "step " in res.reason and "lr 1e+30" in res.reason, res.reason
    assert all(math.isfinite(s.drift_dedup) for s in res.steps)  # no step with nan figures is kept


def test_a_sane_run_still_passes():
    res = verify_training(TrainConfig(model="tiny-qwen3", steps=2, num_batches=1))
    assert res.status == "pass", res.reason
