"""Goodput from the simulator: the highest request rate at which >= 90% of requests meet both SLOs.

The rate search draws one trace up front: request lengths from the workload and a unit-rate
Poisson arrival sequence, both from a fixed seed. A probe at rate r divides those arrival times by
r, so probes differ only in rate (common random numbers), which keeps attainment close to monotone
in r. The search: check that a trickle meets the target (else goodput is 0), double or halve from
a capacity guess until the target is bracketed, then bisect until the bracket is within `rel_tol`.
Each probe stops early once 10% misses are certain.

A probe takes the trace's fixed number of requests (e.g. 300), or more when that many would arrive
within `span_latencies` lone-request latencies: a fleet serving tens of requests a second finishes
300 of them as one burst it drains afterwards, never reaching its steady-state queues, and
attainment at a rate past its capacity still looks fine (13B on 8 simulated GPUs at 160 req/s:
98% with 400 requests, 7% with 6,000). Goodput still falls a little as the span grows (near
capacity queues build slowly): 4c@2 there gives 63 req/s at 10 latencies, 54 at 20, 51 at 40.
On the CPU box's rates the fixed count already spans that.
"""

from __future__ import annotations

import dataclasses
import math
import random

from distserve.planner.profile import Profile
from distserve.planner.sim_metrics import SimSummary, Slo
from distserve.planner.simulator import ClusterConfig, Request, simulate

TARGET = 0.9
POOL = 20_000  # most requests one probe may take


@dataclasses.dataclass(frozen=True)
class Workload:
    """A length distribution of distserve.bench.workload."""

    name: str = "chat"
    """chat | code | summarize | fixed"""
    input_len: str | None = None
    """fixed only: "N" or "A-B" (uniform)"""
    output_len: str | None = None
    max_context: int | None = None
    """Clip input + output to this many tokens."""

    def lengths(self, num: int, seed: int) -> list[tuple[int, int]]:
        from distserve.bench.workload import sample_lengths  # the benchmark's own distributions
        return sample_lengths(self.name, num, seed, input_len=self.input_len, output_len=self.output_len,
                              max_context=self.max_context)


@dataclasses.dataclass(frozen=True)
class Trace:
    """Request lengths and arrival times at rate 1 (a pool); `at_rate` takes a prefix, times scaled."""

    lengths: tuple[tuple[int, int], ...]
    unit_arrivals: tuple[float, ...]
    num_requests: int = 0
    """Requests a probe takes at least (0: the whole pool)."""

    @classmethod
    def draw(cls, workload: Workload, num: int, seed: int, pool: int = 0) -> "Trace":
        """The requests `distserve bench` sends with this seed (when pool <= num; scale the arrivals by
        1/rate for its poisson_arrivals(rate, ...)), drawn `pool` deep for probes that need more."""
        from distserve.bench.workload import poisson_arrivals
        size = max(num, pool)
        return cls(tuple(workload.lengths(size, seed)), tuple(poisson_arrivals(1.0, size, seed)), num)

    @classmethod
    def from_lengths(cls, lengths: list[tuple[int, int]], seed: int = 0) -> "Trace":
        """With this module's own Poisson arrivals (for callers without the bench package)."""
        rng, t, times = random.Random(seed), 0.0, []
        for _ in lengths:
            t += rng.expovariate(1.0)
            times.append(t)
        return cls(tuple(lengths), tuple(times))

    def at_rate(self, rate: float, min_span_s: float = 0.0) -> list[Request]:
        """num_requests requests at `rate`, or more, up to the pool, until they span min_span_s."""
        num = min(max(self.num_requests or len(self.lengths), math.ceil(rate * min_span_s)), len(self.lengths))
        return [Request(t / rate, n_in, n_out)
                for t, (n_in, n_out) in zip(self.unit_arrivals[:num], self.lengths[:num])]

    @property
    def mean_input(self) -> float:
        return sum(n for n, _ in self.lengths) / len(self.lengths)


@dataclasses.dataclass(frozen=True)
class RateSearch:
    target: float = TARGET
    rel_tol: float = 0.03
    """Stop bisecting when the bracket's high end is within this fraction of its low end."""
    max_probes: int = 24
    trickle_factor: float = 1e-3
    """The "trickle" rate, as a fraction of the capacity guess."""
    span_latencies: float = 30.0
    """A probe's arrivals span at least this many lone-request latencies (see the module docstring);
    0: always the trace's num_requests."""


@dataclasses.dataclass(frozen=True)
class Goodput:
    rate: float
    """Requests/s meeting the target; 0 when even a trickle misses it."""
    attainment: float
    """Attainment at `rate`."""
    probes: tuple[tuple[float, float], ...]
    """(rate, attainment) of every simulation run, in order."""


def attainment_at(config: ClusterConfig, trace: Trace, rate: float, slo: Slo, target: float = TARGET,
                  min_span_s: float = 0.0) -> float:
    """Attainment at `rate`; below `target` it may be an over-estimate (the run stops early)."""
    return simulate(config, trace.at_rate(rate, min_span_s), slo, stop_below=target).summary.attainment


def lone_latency(config: ClusterConfig, trace: Trace, num: int = 50) -> float:
    """Mean end-to-end latency of the trace's first `num` requests, each alone in the fleet."""
    lone = [Request(i * 1e6, n_in, n_out) for i, (n_in, n_out) in enumerate(trace.lengths[:num])]
    results = simulate(config, lone).results
    return sum(r.e2e_s for r in results) / len(results)


def capacity_guess(config: ClusterConfig, trace: Trace) -> float:
    """Requests/s the entry workers could prefill back to back: a start for the search, no more."""
    mean_in = max(int(trace.mean_input), 1)
    rates = []
    for w in config.workers:
        if w.role != "decode":  # prompts/s = (tokens/s of one chunk) / tokens per prompt
            chunk = min(mean_in, w.budget)
            rates.append(chunk / max(w.profile.prefill_time([(chunk, 0)]), 1e-9) / mean_in)
    if not rates:  # decode-only fleet: a guess of 100 output tokens per request
        rates = [w.max_running / max(w.profile.decode_time([mean_in] * w.max_running), 1e-9) / 100
                 for w in config.workers]
    return sum(rates)


def find_goodput(config: ClusterConfig, trace: Trace, slo: Slo, search: RateSearch = RateSearch(),
                 guess: float | None = None) -> Goodput:
    """The highest rate (within search.rel_tol) whose attainment is >= search.target."""
    probes: list[tuple[float, float]] = []
    span_s = search.span_latencies * lone_latency(config, trace) if search.span_latencies else 0.0

    def passes(rate: float) -> bool:
        probes.append((rate, attainment_at(config, trace, rate, slo, search.target, span_s)))
        return probes[-1][1] >= search.target

    guess = guess or capacity_guess(config, trace)
    lo = guess * search.trickle_factor
    if not passes(lo):
        return Goodput(0.0, probes[0][1], tuple(probes))
    lo, hi = _bracket(passes, lo, guess, lambda: len(probes) < search.max_probes)
    while hi > lo * (1 + search.rel_tol) and len(probes) < search.max_probes:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if passes(mid) else (lo, mid)
    return Goodput(lo, next(a for r, a in reversed(probes) if r == lo), tuple(probes))


def _bracket(passes, lo: float, guess: float, may_probe) -> tuple[float, float]:
    """(passing rate, failing rate) found by doubling up from `guess` or halving down to `lo`."""
    if passes(guess):
        rate = guess
        while may_probe() and passes(rate * 2):
            rate *= 2
        return rate, rate * 2
    hi = guess
    while hi / 2 > lo and may_probe():
        if passes(hi / 2):
            return hi / 2, hi
        hi /= 2
    return lo, hi


def run_config(profiles: list[Profile], fleet: str | ClusterConfig, workload: Workload | Trace,
               rates: list[float], slo: Slo | None = None, num_requests: int = 300,
               seed: int = 0) -> dict[float, SimSummary]:
    """Simulates one fleet at each rate: {rate: summary (attainment, percentiles)}, for comparing
    the simulator with measurements. `fleet` is a fleet string ("1p1d", see fleet_spec) or a
    ClusterConfig; `workload` a Workload (drawn with `seed`) or a ready Trace."""
    from distserve.planner.fleet_spec import parse_workers
    config = fleet if isinstance(fleet, ClusterConfig) else ClusterConfig(tuple(parse_workers(fleet, profiles)))
    trace = workload if isinstance(workload, Trace) else Trace.draw(workload, num_requests, seed)
    return {rate: simulate(config, trace.at_rate(rate), slo).summary for rate in rates}
