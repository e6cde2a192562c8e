"""Measured cost of a forward as a line in its size, for turning queued work into expected busy time.

A worker publishes what its forwards cost (`CostMeter.fixed`, `CostMeter.per_unit`) and what it has
queued; the router combines the two to compare workers whose speeds differ (dtype, cores, model)
without knowing why they differ (see services.router.picker, spilling).

Why a line and not seconds per unit: a decode step streams the weights once whatever its batch, so
per decoded token it costs ~7x more at batch 1 than at batch 25 on the default model. A per-token
average taken at one worker's batch, compared with one taken at another's, sent a burst's spilled
requests 31 : 19 to the worker that happened to have measured its cost at the larger batch.
"""

from __future__ import annotations


class CostMeter:
    """seconds ~= fixed + per_unit * units over recent forwards (units: prompt tokens, or sequences
    in a decode step), fitted by exponentially weighted least squares.

    Forwards of one size alone cannot show a slope: a prior (`set_prior`, forwards timed at start-up
    at two sizes) that never decays supplies it, and without one the line goes through the origin
    (seconds per unit, fixed 0). A fit with a negative part keeps the other part alone (costs are
    never negative)."""

    def __init__(self, weight: float = 0.1):
        self._weight = weight  # each forward's weight decays by (1 - weight) per newer one: ~1 / weight make the fit
        # weighted sums over forwards of 1, x, x^2, y, x*y (x: units, y: seconds)
        self._n = self._x = self._xx = self._y = self._xy = 0.0
        self._prior = (0.0,) * 5  # the same sums over the prior's forwards
        self.fixed = 0.0  # seconds a forward costs whatever its size
        self.per_unit = 0.0  # seconds each unit adds (0 with fixed 0: nothing measured yet)

    def set_prior(self, forwards: list[tuple[int, float]], weight: float = 1.0) -> None:
        """(units, seconds) of forwards that count as `weight` forwards each in every fit, never decaying."""
        self._prior = tuple(weight * sum(term) for term in zip(*((1.0, u, u * u, s, u * s) for u, s in forwards)))
        self.fixed, self.per_unit = self._fit()

    def observe(self, seconds: float, units: int) -> None:
        """One forward of `units` that took `seconds`; forwards without units are not evidence."""
        if units <= 0:
            return
        keep = 1.0 - self._weight if self._n else 0.0
        self._n = keep * self._n + 1.0
        self._x = keep * self._x + units
        self._xx = keep * self._xx + units * units
        self._y = keep * self._y + seconds
        self._xy = keep * self._xy + units * seconds
        self.fixed, self.per_unit = self._fit()

    def _fit(self) -> tuple[float, float]:
        recent = (self._n, self._x, self._xx, self._y, self._xy)
        n, x, xx, y, xy = (a + b for a, b in zip(recent, self._prior))
        if not n:
            return 0.0, 0.0
        spread = n * xx - x * x  # n^2 * variance of x
        if spread > 1e-9 * n * xx:
            slope = (n * xy - x * y) / spread
            intercept = (y - slope * x) / n
            if slope >= 0 and intercept >= 0:
                return intercept, slope
            if slope < 0:  # bigger forwards measured no slower: all of it is fixed
                return y / n, 0.0
        return 0.0, xy / xx  # through the origin: least squares of y = per_unit * x

    def seconds(self, units: float) -> float:
        """Expected seconds of one forward of `units` (0 until measured)."""
        return self.fixed + self.per_unit * units
