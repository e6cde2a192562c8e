"""The bench's statistics on synthetic traces whose answers are worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from distserve.bench.stats import (
    RequestRecord,
    attainment,
    format_summary,
    goodput,
    latency_ms,
    results_document,
    summarize_rate,
    summarize_repeats,
)

SLO_TTFT_S, SLO_TPOT_S = 0.2, 0.05


def record(ttft_s, e2e_s, output_len=11, ok=True, error=""):
    return RequestRecord(arrival_s=0.0, input_len=16, output_len=output_len, ttft_s=ttft_s, e2e_s=e2e_s, ok=ok,
                         error=error)


def trace() -> list[RequestRecord]:
    """Five requests: two meet both SLOs, one misses TTFT, one misses TPOT, one failed."""
    return [
        record(0.1, 0.6),  # tpot (0.6-0.1)/10 = 0.05: meets (<=)
        record(0.2, 0.4),  # ttft exactly at the SLO, tpot 0.02: meets
        record(0.3, 0.5),  # ttft over
        record(0.1, 1.1),  # tpot 0.1 over
        record(None, None, output_len=0, ok=False, error="HTTP 503: no decode worker"),
    ]


def test_tpot_as_vllm_computes_it_and_undefined_for_one_token():
    assert record(0.1, 0.6).tpot_s == pytest.approx(0.05)
    one = record(0.1, 0.1, output_len=1)
    assert one.tpot_s is None
    assert one.meets(SLO_TTFT_S, SLO_TPOT_S)  # TPOT SLO met trivially
    assert not record(0.3, 0.3, output_len=1).meets(SLO_TTFT_S, SLO_TPOT_S)  # TTFT still counts


def test_attainment_counts_failures_as_misses():
    assert attainment(trace(), SLO_TTFT_S, SLO_TPOT_S) == pytest.approx(2 / 5)
    assert attainment(trace()[:2], SLO_TTFT_S, SLO_TPOT_S) == 1.0
    assert attainment([], SLO_TTFT_S, SLO_TPOT_S) == 0.0


def test_percentiles_by_hand():
    # [10, 20, 30, 40] ms: p50 halfway between 20 and 30; p90 at index 2.7 -> 30 + 0.7 * 10; p99 at 2.97
    got = latency_ms([0.01, 0.04, 0.02, 0.03])
    assert got == pytest.approx({"mean": 25.0, "p50": 25.0, "p90": 37.0, "p99": 39.7})
    assert latency_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_goodput_interpolates_the_first_crossing():
    # 0.95 at 2 rps, 0.85 at 4 rps: the 0.9 line is crossed halfway, at 3 rps
    assert goodput([1, 2, 4, 8], [1.0, 0.95, 0.85, 0.2]) == (pytest.approx(3.0), False)
    assert goodput([4, 1, 2], [0.85, 1.0, 0.95]) == (pytest.approx(3.0), False)  # order does not matter
    assert goodput([1, 2], [0.9, 0.5]) == (1.0, False)  # exactly at target: meets, crossing at r_i


def test_goodput_ignores_recovery_after_a_miss_and_is_zero_when_lowest_misses():
    assert goodput([1, 2, 4], [0.95, 0.85, 0.95]).rps == pytest.approx(1.0 + 0.05 / 0.10)
    assert goodput([1, 2, 4], [0.8, 0.95, 0.95]) == (0.0, False)


def test_goodput_lower_bound_when_all_meet_or_the_next_rate_is_inf():
    assert goodput([1, 2, 4], [1.0, 0.95, 0.91]) == (4.0, True)
    assert goodput([1, 2, math.inf], [1.0, 0.95, 0.5]) == (2.0, True)
    assert goodput([1, math.inf], [1.0, 1.0]) == (1.0, True)


def test_rate_summary_and_document_follow_the_schema():
    rate = summarize_rate(math.inf, 2.0, trace(), SLO_TTFT_S, SLO_TPOT_S)
    assert rate["rate"] == "inf"
    assert (rate["num_requests"], rate["num_ok"]) == (5, 4)
    assert rate["request_throughput"] == 2.0 and rate["output_throughput"] == 22.0  # 4 ok * 11 tokens / 2 s
    assert rate["attainment"] == pytest.approx(0.4)
    assert rate["ttft_ms"]["p50"] == pytest.approx(150.0)  # ok requests only: 100, 100, 200, 300
    assert rate["tpot_ms"]["mean"] == pytest.approx((50 + 20 + 20 + 100) / 4)
    assert rate["requests"][4] == {"arrival_s": 0.0, "input_len": 16, "output_len": 0, "ttft_s": None,
                                   "tpot_s": None, "itl_p99_s": None, "max_stall_s": None, "e2e_s": None,
                                   "ok": False, "error": "HTTP 503: no decode worker"}
    low = summarize_rate(1.0, 5.0, trace()[:2], SLO_TTFT_S, SLO_TPOT_S)
    doc = results_document("disagg", "http://x", "m", {"name": "fixed", "input_len": "16", "output_len": "11",
                                                       "num_prompts": 5, "seed": 0}, 200, 50, [low, rate])
    assert set(doc) == {"label", "url", "model", "workload", "slo", "goodput_rps", "goodput_is_lower_bound", "rates"}
    assert (doc["goodput_rps"], doc["goodput_is_lower_bound"]) == (1.0, True)
    assert json.loads(json.dumps(doc, allow_nan=False)) == doc
    table = format_summary(doc)
    assert "goodput: >= 1.00 req/s" in table and "   4/5" in table


def test_no_finished_request_gives_zero_throughput():
    rate = summarize_rate(1.0, 0.0, [record(None, None, 0, ok=False, error="x")], SLO_TTFT_S, SLO_TPOT_S)
    assert rate["request_throughput"] == 0.0 and rate["attainment"] == 0.0 and rate["ttft_ms"]["p50"] is None


def test_itl_counts_each_chunks_gap_once_per_token_and_stalls_fail_their_slo():
    gaps = (0.02,) * 98 + (0.5, 0.5)  # one chunk of 2 tokens after a 500 ms stall
    stalled = RequestRecord(0.0, 10, 101, ttft_s=0.1, e2e_s=0.1 + 2.96, ok=True, token_gaps_s=gaps)
    assert stalled.tpot_s == pytest.approx(0.0296)  # the mean hides the stall
    assert stalled.max_stall_s == 0.5 and stalled.itl_p99_s == pytest.approx(0.5)
    assert stalled.meets(SLO_TTFT_S, SLO_TPOT_S)  # without ITL SLOs, as before
    assert not stalled.meets(SLO_TTFT_S, SLO_TPOT_S, slo_itl_p99_s=0.1)
    assert not stalled.meets(SLO_TTFT_S, SLO_TPOT_S, slo_stall_s=0.3)
    assert stalled.meets(SLO_TTFT_S, SLO_TPOT_S, slo_itl_p99_s=0.6, slo_stall_s=0.6)
    summary = summarize_rate(1.0, 3.0, [stalled], SLO_TTFT_S, SLO_TPOT_S, slo_stall_s=0.3)
    assert summary["attainment"] == 0.0 and summary["max_stall_ms"]["p50"] == pytest.approx(500.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(sum(gaps) / len(gaps) * 1000)


def test_repeats_pool_their_requests_and_keep_each_ones_attainment_and_goodput():
    good, bad = trace()[:2], trace()[2:4]  # attainment 1.0 and 0.0
    low = summarize_repeats(1.0, [(5.0, good), (5.0, good)], SLO_TTFT_S, SLO_TPOT_S)
    high = summarize_repeats(2.0, [(2.0, good), (2.0, bad)], SLO_TTFT_S, SLO_TPOT_S)
    assert high["num_requests"] == 4 and high["attainment"] == 0.5  # pooled: the repeats' mean
    assert [r["attainment"] for r in high["repeats"]] == [1.0, 0.0]
    assert high["output_throughput"] == pytest.approx(4 * 11 / 4.0)  # every ok token over both durations
    doc = results_document("x", "http://x", "m", {}, 200, 50, [low, high])
    # pooled: 1.0 then 0.5 crosses 0.9 at 1.2 req/s; per repeat: >= 2.0 (never misses), and 1.0 + 0.1 / 1.0
    assert doc["goodput_rps"] == pytest.approx(1.2)
    assert doc["goodput_repeats_rps"] == pytest.approx([2.0, 1.1])
    assert "(0-100% over 2 repeats)" in format_summary(doc) and "per repeat 1.10-2.00" in format_summary(doc)
    assert "repeats" not in summarize_repeats(1.0, [(5.0, good)], SLO_TTFT_S, SLO_TPOT_S)
