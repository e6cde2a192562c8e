"""CostMeter: a forward's seconds as fixed + per_unit * units, fitted over recent forwards."""

from __future__ import annotations

import pytest

from distserve.engine.cost_meter import CostMeter


def test_nothing_measured_costs_nothing_and_a_forward_without_units_is_no_evidence():
    meter = CostMeter()
    assert (meter.fixed, meter.per_unit) == (0.0, 0.0)
    meter.observe(1.0, 0)
    assert (meter.fixed, meter.per_unit) == (0.0, 0.0)


def test_forwards_of_one_size_give_seconds_per_unit_through_the_origin():
    meter = CostMeter(weight=0.5)
    meter.observe(0.2, 100)
    assert (meter.fixed, meter.per_unit) == (0.0, pytest.approx(0.002))
    meter.observe(0.4, 100)  # the older forward now counts half
    assert (meter.fixed, meter.per_unit) == (0.0, pytest.approx((0.5 * 0.2 + 0.4) / (0.5 * 100 + 100)))
    meter.observe(3.0, 0)
    assert meter.per_unit == pytest.approx((0.5 * 0.2 + 0.4) / (0.5 * 100 + 100))


def test_forwards_of_several_sizes_separate_the_fixed_cost_from_each_units():
    meter = CostMeter()
    for batch in (1, 4, 16, 25, 8, 2):  # a decode step: 7 ms whatever the batch, 1 ms per sequence
        meter.observe(0.007 + 0.001 * batch, batch)
    assert meter.fixed == pytest.approx(0.007)
    assert meter.per_unit == pytest.approx(0.001)
    assert meter.seconds(25) == pytest.approx(0.032)


def test_the_newest_forwards_weigh_most():
    meter = CostMeter(weight=0.5)
    for batch in (1, 10, 1, 10):
        meter.observe(0.01 * batch, batch)  # all per unit
    for batch in (1, 10) * 10:
        meter.observe(0.005 + 0.002 * batch, batch)  # the worker changed: a fixed cost appeared
    assert meter.fixed == pytest.approx(0.005, rel=1e-3)
    assert meter.per_unit == pytest.approx(0.002, rel=1e-3)


def test_a_cost_never_goes_negative():
    bigger_is_faster = CostMeter(weight=0.5)
    for batch, seconds in ((1, 0.03), (10, 0.02)):
        bigger_is_faster.observe(seconds, batch)
    # all of it fixed: the weighted mean, the older forward counting half
    assert (bigger_is_faster.fixed, bigger_is_faster.per_unit) == (pytest.approx((0.5 * 0.03 + 0.02) / 1.5), 0.0)
    below_the_origin = CostMeter(weight=0.5)
    for batch, seconds in ((10, 0.005), (20, 0.02)):  # the line through them crosses zero at batch 6.7
        below_the_origin.observe(seconds, batch)
    assert below_the_origin.fixed == 0.0
    assert below_the_origin.per_unit == pytest.approx((0.5 * 10 * 0.005 + 20 * 0.02) / (0.5 * 10 ** 2 + 20 ** 2))


def test_a_prior_gives_the_slope_that_forwards_of_one_size_cannot():
    meter = CostMeter()
    meter.set_prior([(1, 0.008), (32, 0.055)])  # start-up: 8 ms at batch 1, 55 ms at batch 32
    assert meter.seconds(1) == pytest.approx(0.008) and meter.seconds(32) == pytest.approx(0.055)
    for _ in range(50):
        meter.observe(0.010, 1)  # served at batch 1 only, a little slower than at start-up
    assert meter.seconds(1) == pytest.approx(0.010, rel=0.05)
    assert meter.per_unit > 0.001  # a batch of 32 still costs more than one of 1, though none was served
    assert meter.seconds(32) > 4 * meter.seconds(1)
