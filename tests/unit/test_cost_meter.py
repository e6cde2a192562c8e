"""CostMeter: seconds per unit of work, as a moving average of measured forwards."""

from __future__ import annotations

import pytest

from distserve.engine.cost_meter import CostMeter


def test_first_forward_sets_the_cost_then_each_moves_it_by_the_weight():
    meter = CostMeter(weight=0.5)
    assert meter.per_unit == 0.0  # nothing measured
    meter.observe(0.2, 100)
    assert meter.per_unit == pytest.approx(0.002)
    meter.observe(0.4, 100)
    assert meter.per_unit == pytest.approx(0.003)


def test_a_forward_without_units_is_no_evidence():
    meter = CostMeter()
    meter.observe(1.0, 0)
    assert meter.per_unit == 0.0
    meter.observe(0.05, 10)
    meter.observe(3.0, 0)
    assert meter.per_unit == pytest.approx(0.005)
