"""distserve.bench.adaptive: rates double until the SLO target is missed, then bisect around the knee."""

from __future__ import annotations

import pytest

from distserve.bench.adaptive import MAX_RATE, MAX_RUNS, RESOLUTION, next_rate
from distserve.bench.stats import goodput


def search(knee: float, start: float = 0.5) -> list[float]:
    """The rates run against a system meeting the target exactly up to `knee` req/s."""
    measured = []
    while (rate := next_rate(measured, 0.9, start)) is not None:
        measured.append((rate, 1.0 if rate <= knee else 0.5))
    return [rate for rate, _ in measured]


def test_it_doubles_to_the_first_miss_then_bisects_to_the_resolution():
    rates = search(knee=5.0)
    assert rates[:5] == [0.5, 1.0, 2.0, 4.0, 8.0]
    met = max(r for r in rates if r <= 5.0)
    missed = min(r for r in rates if r > 5.0)
    assert (missed - met) / missed <= RESOLUTION and met <= 5.0 < missed
    assert len(rates) <= MAX_RUNS


def test_goodput_from_the_searched_rates_lands_near_the_knee():
    rates = search(knee=13.0)
    found = goodput(rates, [1.0 if r <= 13.0 else 0.5 for r in rates])
    assert found.rps == pytest.approx(13.0, rel=2 * RESOLUTION) and not found.is_lower_bound


def test_a_system_meeting_every_rate_stops_at_the_ceiling_and_one_missing_the_start_goes_lower():
    assert search(knee=1e9)[-1] == MAX_RATE
    low = search(knee=0.1)
    assert low[:3] == [0.5, 0.25, 0.125] and min(low) >= 0.5 / 16
