"""FittedProfile: the DistServe paper's step-time model, in our Profile's terms."""

from __future__ import annotations

import pytest

from distserve.planner.fitted_profile import StepFit, fitted_profile
from distserve.planner.profile import StepShape

FIT = StepFit(prefill=(10.0, 0.1, 1e-4), decode_small_batch=(20.0, 0.001, 0.5), decode_large_batch=(5.0, 0.002, 1.0),
              large_batch_from=4)


def profile():
    return fitted_profile("toy", FIT, gpus=2, kv_capacity_tokens=1000, kv_bytes_per_token=10, max_batch_tokens=512,
                          source="a test")


def test_a_prefill_step_is_the_papers_quadratic_in_prompt_lengths_plus_its_overheads():
    seconds = profile().prefill_time([(100, 0), (300, 0)])
    squares = 100 ** 2 + 300 ** 2
    expected_ms = 10 + 0.1 * 400 + 1e-4 * squares + 1 + 2 + 1e-4 * 400  # fit, pp const, per-step overhead
    assert seconds == pytest.approx(expected_ms / 1e3)


def test_decode_steps_switch_to_the_large_batch_fit_at_its_threshold():
    small = profile().decode_time([100, 200, 300])
    large = profile().decode_time([100, 200, 300, 400])
    assert small == pytest.approx((20 + 0.001 * 603 + 0.5 * 3 + 2 + 1e-4 * 600) / 1e3)
    assert large == pytest.approx((5 + 0.002 * 1004 + 1.0 * 4 + 2 + 1e-4 * 1000) / 1e3)


def test_a_mixed_step_pays_one_constant():
    mixed = profile().step_time(StepShape(chunks=((100, 0),), decode_contexts=(50, 50)))
    prefill = profile().prefill_time([(100, 0)])
    decode_rows_ms = 0.001 * 102 + 0.5 * 2 + 1e-4 * 100  # no second a_d, one more overhead share
    assert mixed == pytest.approx(prefill + decode_rows_ms / 1e3)
    assert profile().cores_per_worker == 2 and profile().transfer_time(10 ** 9) == 0.0
