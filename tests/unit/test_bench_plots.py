"""The bench's charts: written from results.json documents, inf rates included, failed requests skipped."""

from __future__ import annotations

import math

from distserve.bench.plots import plot_attainment, plot_latency_cdf
from distserve.bench.stats import RequestRecord, results_document, summarize_rate, summarize_repeats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(label: str, scale: float) -> dict:
    rates = []
    for rate in (1.0, 2.0, math.inf):
        load = min(rate, 4.0) * scale  # latencies grow with the rate: attainment falls
        records = [RequestRecord(0.0, 8, 4, 0.02 * load * i, 0.05 * load * i, True) for i in (1, 2, 3)]
        records.append(RequestRecord(0.0, 8, 0, None, None, False, "HTTP 503"))
        rates.append(summarize_rate(rate, 1.0, records, 0.1, 0.05))
    workload = {"name": "fixed", "input_len": "8", "output_len": "4", "num_prompts": 4, "seed": 0}
    return results_document(label, "http://x", "m", workload, 100, 50, rates)


def test_attainment_chart_overlays_runs(tmp_path):
    path = tmp_path / "attainment.png"
    plot_attainment([run("disagg", 1.0), run("colocated", 2.0)], path)
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 1000


def test_latency_cdf_chart(tmp_path):
    path = tmp_path / "latency_cdf.png"
    plot_latency_cdf(run("disagg", 1.0), path)
    assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 1000


def test_attainment_chart_draws_the_repeats_spread_as_error_bars(tmp_path):
    def records(load: float) -> list:
        return [RequestRecord(0.0, 8, 4, 0.02 * load * i, 0.05 * load * i, True) for i in (1, 2, 3)]

    rates = [summarize_repeats(rate, [(1.0, records(rate)), (1.0, records(2 * rate))], 0.1, 0.05)
             for rate in (1.0, 2.0)]
    pooled_only = [{k: v for k, v in r.items() if k != "repeats"} for r in rates]  # the same points, no spread
    assert rates[0]["repeats"][0]["attainment"] != rates[0]["repeats"][1]["attainment"]
    plain, spread = tmp_path / "plain.png", tmp_path / "spread.png"
    plot_attainment([results_document("repeated", "http://x", "m", {}, 100, 50, pooled_only)], plain)
    plot_attainment([results_document("repeated", "http://x", "m", {}, 100, 50, rates)], spread)
    assert spread.read_bytes().startswith(PNG_MAGIC) and spread.read_bytes() != plain.read_bytes()  # the bars
