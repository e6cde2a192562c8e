"""SLOs, per-request latencies and their summary (attainment, percentiles)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Slo:
    """Latency targets; a request meets the SLO when it meets both."""

    ttft_s: float = math.inf  # time to first token
    tpot_s: float = math.inf  # time per output token after the first

    def is_met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s <= self.ttft_s and tpot_s <= self.tpot_s

    def label(self) -> str:
        return f"TTFT {self.ttft_s * 1e3:g} ms, TPOT {self.tpot_s * 1e3:g} ms"


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """One request's latencies; all inf when it was never served (rejected, or the run stopped early).
    tpot_s is 0 for single-token outputs, whose TPOT target is met trivially."""

    ttft_s: float
    tpot_s: float
    e2e_s: float


@dataclasses.dataclass(frozen=True)
class SimSummary:
    num_requests: int
    num_served: int  # requests that finished before the run ended
    attainment: float  # fraction of all requests meeting the SLO (nan without one)
    is_complete: bool  # False: stopped early once attainment could no longer reach the target
    duration_s: float  # first arrival -> last finish (simulated)
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p90_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(results: list[RequestResult], slo: Slo | None, is_complete: bool,
              duration_s: float) -> SimSummary:
    """Percentiles are over served requests; attainment is over all of them."""
    served = [r for r in results if math.isfinite(r.e2e_s)]
    met = sum(slo.is_met(r.ttft_s, r.tpot_s) for r in results) if slo else 0
    ttft, tpot, e2e = ([getattr(r, f) for r in served] for f in ("ttft_s", "tpot_s", "e2e_s"))
    return SimSummary(
        num_requests=len(results), num_served=len(served),
        attainment=met / len(results) if slo and results else math.nan, is_complete=is_complete,
        duration_s=duration_s,
        ttft_p50_s=_percentile(ttft, 50), ttft_p90_s=_percentile(ttft, 90), ttft_p99_s=_percentile(ttft, 99),
        tpot_p50_s=_percentile(tpot, 50), tpot_p90_s=_percentile(tpot, 90), tpot_p99_s=_percentile(tpot, 99),
        e2e_p50_s=_percentile(e2e, 50), e2e_p99_s=_percentile(e2e, 99))
