"""Per-request timings -> latency percentiles, SLO attainment, goodput and the results.json document.

Definitions (DistServe, OSDI'24; TPOT as vLLM's benchmark computes it):

- TTFT: send -> first chunk carrying output. E2E: send -> end of the stream.
- TPOT = (E2E - TTFT) / (output tokens - 1); undefined for 0 or 1 output tokens,
  and such a request meets the TPOT SLO trivially.
- ITL (inter-token latency), per token: the gap between a chunk and the one before
  it, counted once for each token the chunk carries (a chunk of 4 tokens after a
  200 ms gap is four 200 ms gaps: what a reader of the stream waited for each).
  A request's ITL p99 is the 99th percentile of its own gaps; its longest stall,
  the longest gap. Mean TPOT hides both.
- A request meets the SLOs when it succeeded, TTFT <= the TTFT SLO, TPOT (when
  defined) <= the TPOT SLO, and, when set, its ITL p99 and its longest stall
  within theirs. Attainment is the fraction of ALL sent requests that meet them:
  failures count as misses.
- Goodput: the highest request rate whose attainment is >= the target (90%);
  see `goodput` for how it is read off the measured rates.

Everything here is pure: no I/O, no clocks, so tests feed it synthetic traces.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

ATTAINMENT_TARGET = 0.9


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds; ttft_s / e2e_s are None when never reached."""

    arrival_s: float  # scheduled offset from the start of its rate's run
    input_len: int
    output_len: int  # output tokens received (usage when the server reports it, else content chunks)
    ttft_s: float | None
    e2e_s: float | None
    ok: bool
    error: str = ""
    token_gaps_s: tuple[float, ...] = ()  # per output token after the first chunk: the gap its chunk waited

    @property
    def itl_p99_s(self) -> float | None:
        return float(np.percentile(self.token_gaps_s, 99)) if self.token_gaps_s else None

    @property
    def max_stall_s(self) -> float | None:
        return max(self.token_gaps_s) if self.token_gaps_s else None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_len <= 1 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)

    def meets(self, slo_ttft_s: float, slo_tpot_s: float, slo_itl_p99_s: float | None = None,
              slo_stall_s: float | None = None) -> bool:
        """The SLOs in the module docstring; an ITL or stall SLO of None is not checked."""
        return meets(self.to_json(), slo_ttft_s, slo_tpot_s, slo_itl_p99_s, slo_stall_s)

    def to_json(self) -> dict[str, Any]:
        return {"arrival_s": self.arrival_s, "input_len": self.input_len, "output_len": self.output_len,
                "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "itl_p99_s": self.itl_p99_s,
                "max_stall_s": self.max_stall_s, "e2e_s": self.e2e_s, "ok": self.ok, "error": self.error}


class Goodput(NamedTuple):
    rps: float
    is_lower_bound: bool  # every measured rate up to the last finite one met the target


def latency_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in ms (numpy's linear interpolation between order statistics); None when empty."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def attainment(records: Sequence[RequestRecord], slo_ttft_s: float, slo_tpot_s: float,
               slo_itl_p99_s: float | None = None, slo_stall_s: float | None = None) -> float:
    """Fraction of all sent requests (failed ones included, as misses) meeting the SLOs; 0.0 when none."""
    if not records:
        return 0.0
    return sum(r.meets(slo_ttft_s, slo_tpot_s, slo_itl_p99_s, slo_stall_s) for r in records) / len(records)


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float = ATTAINMENT_TARGET) -> Goodput:
    """The highest rate that still meets `target`, read off the curve where it first drops below it.

    Rates are sorted ascending. Let r_i be the last rate of the leading run of rates
    that meet the target, and r_j the rate right after it (which misses). Then

        goodput = r_i + (a_i - target) / (a_i - a_j) * (r_j - r_i)

    (the linear crossing of the target between the two measured points). A rate that
    meets the target again after a miss is not counted: that is noise, and goodput
    claims the system holds the SLOs at every rate up to it.

    - The lowest rate misses: 0.0. Nothing is assumed below the lowest measured rate
      (attainment at rate -> 0 is not 1.0 when an idle request already misses a SLO).
    - Every finite rate meets: the highest finite rate, flagged as a lower bound.
      Likewise when the rate after r_i is inf: one cannot interpolate toward inf.
    """
    points = sorted(zip(rates, attainments))
    last_met = None
    for index, (_, att) in enumerate(points):
        if att < target:
            break
        last_met = index
    if last_met is None:
        return Goodput(0.0, False)
    after = last_met + 1
    finite_met = [r for r, _ in points[:after] if math.isfinite(r)]
    best_finite = finite_met[-1] if finite_met else 0.0
    if after == len(points) or not math.isfinite(points[after][0]):
        return Goodput(best_finite, True)
    (r_i, a_i), (r_j, a_j) = points[last_met], points[after]
    return Goodput(r_i + (a_i - target) / (a_i - a_j) * (r_j - r_i), False)


def rate_to_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def rate_from_json(value: float | str) -> float:
    return float(value)  # float("inf") parses the "inf" string


def meets(record: dict[str, Any], slo_ttft_s: float, slo_tpot_s: float, slo_itl_p99_s: float | None = None,
          slo_stall_s: float | None = None) -> bool:
    """Whether one request (RequestRecord.to_json, as results.json keeps it) met the SLOs in the module
    docstring; an ITL or stall SLO of None is not checked. Offline readers re-judge runs with it."""
    if not record["ok"] or record["ttft_s"] is None or record["ttft_s"] > slo_ttft_s:
        return False
    if record["tpot_s"] is not None and record["tpot_s"] > slo_tpot_s:
        return False
    for limit, value in ((slo_itl_p99_s, record.get("itl_p99_s")), (slo_stall_s, record.get("max_stall_s"))):
        if limit is not None and value is not None and value > limit:
            return False
    return True


def summarize_rate(rate: float, duration_s: float, records: Sequence[RequestRecord], slo_ttft_s: float,
                   slo_tpot_s: float, slo_itl_p99_s: float | None = None,
                   slo_stall_s: float | None = None) -> dict[str, Any]:
    """One entry of results.json's `rates`: throughput, latency percentiles (ok requests), attainment."""
    ok = [r for r in records if r.ok]
    seconds = duration_s if duration_s > 0 else math.inf  # nothing finished: throughputs are 0
    return {
        "rate": rate_to_json(rate),
        "duration_s": duration_s,
        "num_requests": len(records),
        "num_ok": len(ok),
        "request_throughput": len(ok) / seconds,
        "output_throughput": sum(r.output_len for r in ok) / seconds,
        "ttft_ms": latency_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": latency_ms([gap for r in ok for gap in r.token_gaps_s]),  # every token of every request
        "max_stall_ms": latency_ms([r.max_stall_s for r in ok if r.max_stall_s is not None]),  # one per request
        "e2e_ms": latency_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "attainment": attainment(records, slo_ttft_s, slo_tpot_s, slo_itl_p99_s, slo_stall_s),
        "requests": [r.to_json() for r in records],
    }


def summarize_repeats(rate: float, runs: Sequence[tuple[float, Sequence[RequestRecord]]], slo_ttft_s: float,
                      slo_tpot_s: float, slo_itl_p99_s: float | None = None,
                      slo_stall_s: float | None = None) -> dict[str, Any]:
    """summarize_rate over every repeat of one rate pooled (runs: (duration_s, records) per repeat; the
    pooled attainment is the repeats' mean, as each sends as many requests), and with more than one
    repeat, `repeats`: each one's own attainment, throughput and medians, for the spread."""
    pooled = summarize_rate(rate, sum(d for d, _ in runs), [r for _, records in runs for r in records],
                            slo_ttft_s, slo_tpot_s, slo_itl_p99_s, slo_stall_s)
    if len(runs) > 1:
        pooled["repeats"] = []
        for duration_s, records in runs:
            one = summarize_rate(rate, duration_s, records, slo_ttft_s, slo_tpot_s, slo_itl_p99_s, slo_stall_s)
            pooled["repeats"].append({"duration_s": duration_s, "attainment": one["attainment"],
                                      "output_throughput": one["output_throughput"],
                                      "ttft_p50_ms": one["ttft_ms"]["p50"], "tpot_p50_ms": one["tpot_ms"]["p50"]})
    return pooled


def attainment_spread(rate_summary: dict[str, Any]) -> tuple[float, float]:
    """(lowest, highest) attainment over a rate's repeats; the pooled value twice when it had one."""
    values = [r["attainment"] for r in rate_summary.get("repeats", ())] or [rate_summary["attainment"]]
    return min(values), max(values)


def results_document(label: str, url: str, model: str, workload: dict[str, Any], slo_ttft_ms: float,
                     slo_tpot_ms: float, rates: list[dict[str, Any]], slo_itl_p99_ms: float | None = None,
                     slo_stall_ms: float | None = None) -> dict[str, Any]:
    """The whole results.json: the run's settings, its goodput and each rate's summary."""
    found = goodput([rate_from_json(r["rate"]) for r in rates], [r["attainment"] for r in rates])
    slo = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms,
           **({"itl_p99_ms": slo_itl_p99_ms} if slo_itl_p99_ms is not None else {}),
           **({"stall_ms": slo_stall_ms} if slo_stall_ms is not None else {})}
    document = {"label": label, "url": url, "model": model, "workload": workload, "slo": slo,
                "goodput_rps": found.rps, "goodput_is_lower_bound": found.is_lower_bound, "rates": rates}
    num_repeats = min((len(r.get("repeats", ())) for r in rates), default=0)
    if num_repeats > 1:  # goodput read off each repeat's own curve: the spread of the pooled figure
        each = [goodput([rate_from_json(r["rate"]) for r in rates], [r["repeats"][i]["attainment"] for r in rates])
                for i in range(num_repeats)]
        document["goodput_repeats_rps"] = [g.rps for g in each]
    return document


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_summary(results: dict[str, Any]) -> str:
    """The table printed at the end of a run: one row per rate, then the goodput."""
    header = (f"{'rate':>7} {'ok/sent':>9} {'TTFT ms p50':>12} {'p90':>7} {'p99':>7} {'TPOT ms p50':>12} {'p90':>7} "
              f"{'p99':>7} {'ITL p99':>8} {'stall p99':>10} {'attain':>7}")
    lines = [header]
    for r in results["rates"]:
        ttft, tpot = r["ttft_ms"], r["tpot_ms"]
        itl, stall = r.get("itl_ms", {}).get("p99"), r.get("max_stall_ms", {}).get("p99")  # older results lack them
        lines.append(f"{rate_from_json(r['rate']):>7g} {str(r['num_ok']) + '/' + str(r['num_requests']):>9} "
                     f"{_ms(ttft['p50']):>12} {_ms(ttft['p90']):>7} {_ms(ttft['p99']):>7} {_ms(tpot['p50']):>12} "
                     f"{_ms(tpot['p90']):>7} {_ms(tpot['p99']):>7} {_ms(itl):>8} {_ms(stall):>10} "
                     f"{r['attainment'] * 100:>6.1f}%{_spread(r)}")
    lines.append(goodput_line(results))
    return "\n".join(lines)


def _spread(rate_summary: dict[str, Any]) -> str:
    if "repeats" not in rate_summary:
        return ""
    low, high = attainment_spread(rate_summary)
    return f" ({low * 100:.0f}-{high * 100:.0f}% over {len(rate_summary['repeats'])} repeats)"


def goodput_line(results: dict[str, Any]) -> str:
    slo = results["slo"]
    bound = ">= " if results["goodput_is_lower_bound"] else ""
    extra = "".join(f", {name} <= {slo[key]:g} ms" for key, name in (("itl_p99_ms", "ITL p99"), ("stall_ms", "stall"))
                    if key in slo)
    each = results.get("goodput_repeats_rps")
    spread = f"; per repeat {min(each):.2f}-{max(each):.2f}" if each else ""
    return (f"goodput: {bound}{results['goodput_rps']:.2f} req/s at {ATTAINMENT_TARGET:.0%} attainment "
            f"(TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms{extra}){spread}")
