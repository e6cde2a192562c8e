"""Measured seconds per unit of work, for turning queued work into expected busy time.

A worker publishes what a prompt token and a decoded token cost it (`CostMeter.per_unit`), and what
it has queued; the router multiplies the two to compare workers whose speeds differ (dtype, cores,
model) without knowing why they differ (see services.router.picker, spilling).
"""

from __future__ import annotations


class CostMeter:
    """Seconds per unit (a prompt token, a decoded token): an exponential moving average over forwards."""

    def __init__(self, weight: float = 0.2):
        self._weight = weight  # of the newest forward: a few forwards follow a change of load
        self.per_unit = 0.0  # 0: nothing measured yet

    def observe(self, seconds: float, units: int) -> None:
        """One forward of `units` that took `seconds`; forwards without units are not evidence."""
        if units <= 0:
            return
        sample = seconds / units
        self.per_unit = sample if not self.per_unit else self.per_unit + self._weight * (sample - self.per_unit)
