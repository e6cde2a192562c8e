"""`distserve bench --rates auto`: rates chosen around the knee instead of fixed in advance.

Goodput is read where SLO attainment crosses its target (distserve.bench.stats.goodput), so the rates
that matter are the last one that meets the target and the first that misses it. The search doubles
the rate from a start until one misses, then bisects between the two until they are within
RESOLUTION of each other; when even the start misses, it halves down to the start / 2**MAX_HALVINGS.
Every measured rate stays in results.json, and goodput interpolates between the bracketing pair.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_RATE = 256.0  # req/s; meeting the target here ends the search (goodput is then a lower bound)
RESOLUTION = 0.1  # stop bisecting once (miss - meet) / miss is this small
MAX_HALVINGS = 4
MAX_RUNS = 12


def next_rate(measured: Sequence[tuple[float, float]], target: float, start: float) -> float | None:
    """The next rate to run after `measured` ((rate, attainment) in the order run), or None when done."""
    if not measured:
        return start
    if len(measured) >= MAX_RUNS:
        return None
    points = sorted(measured)
    meet = None  # the last rate of the leading run that meets the target (as goodput reads it)
    for index, (_, attained) in enumerate(points):
        if attained < target:
            break
        meet = index
    if meet is None:  # even the lowest misses: go lower, a while
        lowest = points[0][0]
        return lowest / 2 if lowest / 2 >= start / 2 ** MAX_HALVINGS else None
    if meet == len(points) - 1:  # nothing misses yet: double
        highest = points[-1][0]
        return highest * 2 if highest * 2 <= MAX_RATE else None
    low, high = points[meet][0], points[meet + 1][0]
    if (high - low) / high <= RESOLUTION:
        return None
    return (low + high) / 2
