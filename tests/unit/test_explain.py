"""`distserve explain` on traces recorded from a real system (tests/data/traces/record.py says how).

Each recorded case has a known bottleneck, provoked for real: prefill queueing, a stalled KV transfer,
a crowded decode batch, a migration after a failed transfer, a healthy request, a refused one, and a
healthy request on a colocated worker. (A slow KV transfer cannot break TTFT here: the KV moves after
the first token is sent, so the recorded slow transfer breaks TPOT.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distserve.cli import main
from distserve.explain import TraceNotFound, explain_rows, render, rows_from_jaeger_reply, rows_from_otlp
from distserve.launcher import free_port
from tests.fake_jaeger import fake_jaeger

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
CASES = json.loads((TRACES / "cases.json").read_text())  # case -> the request id recorded for it
SLO_TTFT_S, SLO_TPOT_S = 0.3, 0.06  # the command's defaults


def breakdown(case: str):
    request_id = CASES[case]
    return explain_rows(rows_from_otlp(json.loads((TRACES / f"{case}.otlp.json").read_text()), request_id), request_id)


def headline(case: str) -> str:
    return render(breakdown(case), SLO_TTFT_S, SLO_TPOT_S).splitlines()[0]


def largest(parts) -> list[str]:
    return [p.label for p in sorted(parts, key=lambda p: -p.seconds)]


@pytest.mark.parametrize("case", ["healthy", "prefill_queue", "slow_transfer", "decode_tpot", "migrated",
                                  "colocated"])
def test_the_stretches_add_up_to_ttft_and_to_the_time_after_the_first_token(case):
    b = breakdown(case)
    assert sum(p.seconds for p in b.ttft_parts) == pytest.approx(b.ttft_s, abs=1e-5)
    assert sum(p.seconds for p in b.tpot_parts) == pytest.approx(b.tpot_s * (b.num_output_tokens - 1), abs=1e-5)


def test_a_healthy_request_meets_both_slos_and_blames_nothing():
    b = breakdown("healthy")
    assert b.ttft_s < SLO_TTFT_S and b.tpot_s < SLO_TPOT_S and not b.retries and not b.errors and not b.failure
    line = headline("healthy")
    assert "TTFT" in line and "TPOT" in line and line.count(" ok (SLO") == 2 and "SLO:" not in line
    assert "16 output tokens" in line


def test_prefill_queueing_is_blamed_for_ttft_with_what_the_prompt_waited_behind():
    b = breakdown("prefill_queue")
    assert b.ttft_s > SLO_TTFT_S
    # a burst of 1,744-token prompts, 256 tokens per forward: the prompt waited whole, then its chunks
    # waited between the other prompts' forwards; both dwarf everything else
    assert set(largest(b.ttft_parts)[:2]) == {"prefill queue", "prefill forward"}
    queue = next(p for p in b.ttft_parts if p.label == "prefill queue")
    assert "behind 4 prompts (5,488 tokens)" in queue.detail
    line = headline("prefill_queue")
    assert "TTFT 36.42 s > 300 ms SLO: prefill forward" in line and "in 8 chunks" in line
    assert "and prefill queue 10.46 s (at prefill-" in line and "TPOT 42 ms ok" in line


def test_a_stalled_kv_transfer_is_blamed_for_tpot_not_ttft():
    """The KV moves after the first token is sent, so a slow transfer delays the second token: TPOT."""
    b = breakdown("slow_transfer")
    assert b.ttft_s < SLO_TTFT_S < 0.8
    assert largest(b.tpot_parts)[0] == "KV transfer"
    line = headline("slow_transfer")
    assert "TTFT 43 ms ok" in line
    assert "TPOT 135 ms > 60 ms SLO: KV transfer 805 ms (from prefill-" in line and "of every token's time" in line


def test_a_crowded_decode_batch_is_blamed_for_tpot():
    b = breakdown("decode_tpot")
    assert largest(b.tpot_parts)[0] == "decoding"
    decoding = next(p for p in b.tpot_parts if p.label == "decoding")
    assert decoding.detail.startswith("55 ms per token at decode-") and "63 tokens" in decoding.detail
    assert "TPOT 61 ms > 60 ms SLO: decoding 3.48 s" in headline("decode_tpot")


def test_the_decode_batch_size_is_named_when_the_trace_has_it():
    # decode_tpot was recorded before decode workers put distserve.decode.mean_batch_size on their
    # `generate` span: set it on the recorded row to read it as a newer worker's trace.
    request_id = CASES["decode_tpot"]
    rows = rows_from_otlp(json.loads((TRACES / "decode_tpot.otlp.json").read_text()), request_id)
    generate = next(r for r in rows if r.name == "generate")
    generate.attributes["distserve.decode.mean_batch_size"] = 15.6
    decoding = next(p for p in explain_rows(rows, request_id).tpot_parts if p.label == "decoding")
    assert decoding.detail.endswith("in batches of 15.6 sequences on average")


def test_a_looser_tpot_slo_is_met():
    assert "TPOT 61 ms ok (SLO 70 ms)" in render(breakdown("decode_tpot"), SLO_TTFT_S, 0.07)


def test_a_migrated_request_names_its_retry_the_failed_transfer_and_the_re_prefill():
    b = breakdown("migrated")
    assert len(b.retries) == 1 and "decode at decode-" in b.retries[0] and "DATA_LOSS" in b.retries[0]
    assert "moved on with 1 completion token(s)" in b.retries[0]
    assert len(b.errors) == 1 and b.errors[0].startswith("kv_transfer.recv at decode-")
    assert "timed out after 2 s" in b.errors[0]
    assert largest(b.tpot_parts)[0] == "failed attempts"
    assert {"re-prefill forward", "KV transfer", "decoding"} <= {p.label for p in b.tpot_parts}
    line = headline("migrated")
    assert "TPOT 327 ms > 60 ms SLO: failed attempts 2.03 s (retry 1: decode at" in line and "; 1 retry;" in line


def test_a_colocated_request_is_cut_into_its_one_worker_s_stages():
    b = breakdown("colocated")
    assert [p.label for p in b.ttft_parts][-3:] == ["KV block admission", "prefill queue", "prefill forward"]
    assert [p.label for p in b.tpot_parts] == ["hand-off to decoding", "decoding", "return"]
    assert "TTFT 37 ms ok (SLO 300 ms); TPOT 13 ms ok (SLO 60 ms)" in headline("colocated")


def test_a_refused_request_says_it_failed_before_its_first_token():
    b = breakdown("invalid")
    assert b.ttft_s is None and b.tpot_s is None and b.failure
    text = render(b, SLO_TTFT_S, SLO_TPOT_S)
    assert text.splitlines()[0].startswith("request explain-invalid: no first token")
    assert "the request failed: " in text and "router.generate at distserve-router failed" in text


def test_the_routers_own_reason_names_the_failure():
    # "invalid" was recorded before the router put distserve.error.* on its span: set them on the recorded
    # row to read it as a newer router's trace.
    request_id = CASES["invalid"]
    rows = rows_from_otlp(json.loads((TRACES / "invalid.otlp.json").read_text()), request_id)
    router = next(r for r in rows if r.name == "router.generate")
    router.attributes.update({"distserve.error.code": "INVALID_ARGUMENT",
                              "distserve.error.message": "prompt: 5000 tokens do not fit the model's context"})
    text = render(explain_rows(rows, request_id), SLO_TTFT_S, SLO_TPOT_S)
    assert "INVALID_ARGUMENT: prompt: 5000 tokens do not fit the model's context" in text


def test_the_jaeger_and_otlp_forms_of_a_trace_explain_alike():
    request_id = CASES["prefill_queue"]
    jaeger = rows_from_jaeger_reply(json.loads((TRACES / "prefill_queue.jaeger.json").read_text()), request_id)
    assert render(explain_rows(jaeger, request_id), SLO_TTFT_S, SLO_TPOT_S) == render(
        breakdown("prefill_queue"), SLO_TTFT_S, SLO_TPOT_S)


def test_an_unknown_request_id_is_not_found():
    with pytest.raises(TraceNotFound, match="no trace found for request id nobody"):
        rows_from_otlp(json.loads((TRACES / "healthy.otlp.json").read_text()), "nobody")


def test_cli_explains_an_otlp_file(capsys):
    path = TRACES / "slow_transfer.otlp.json"
    assert main(["explain", CASES["slow_transfer"], "--otlp-file", str(path), "--slo-tpot-ms", "200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("request explain-transfer: TTFT 43 ms ok (SLO 300 ms); TPOT 135 ms ok (SLO 200 ms)")
    assert "  KV transfer " in out and "after the first token, 947 ms for 7 more tokens" in out


def test_cli_says_when_the_request_id_is_unknown(capsys):
    assert main(["explain", "nobody", "--otlp-file", str(TRACES / "healthy.otlp.json")]) == 1
    assert "error: no trace found for request id nobody in " in capsys.readouterr().err


def test_cli_says_when_jaeger_cannot_be_reached(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["explain", "r1", "--jaeger-url", url]) == 1
    assert f"error: cannot read the trace from {url}: " in capsys.readouterr().err


@pytest.fixture
def jaeger():
    """A stand-in for Jaeger's query API answering with the recorded prefill_queue trace; records queries."""
    with fake_jaeger((TRACES / "prefill_queue.jaeger.json").read_bytes()) as (url, queries):
        yield url, queries


def test_cli_explains_a_trace_from_jaeger(jaeger, capsys):
    url, queries = jaeger
    assert main(["explain", CASES["prefill_queue"], "--jaeger-url", url]) == 0
    assert capsys.readouterr().out.startswith("request explain-queue-7: TTFT 36.42 s > 300 ms SLO: prefill forward")
    assert queries and queries[0].startswith("/api/traces?service=distserve-router&tags=")


def test_with_the_routers_first_token_mark_registration_counts_after_the_first_token():
    """The prefill worker streams the first token, then registers the KV: with the router's mark of
    sending it on, TTFT ends there and the registration falls in the time after the first token. The
    recorded healthy trace predates the mark; it is added here where the router would have sent it."""
    from distserve.trace_view import SpanRow
    from distserve.tracing import FIRST_TOKEN_SENT

    request_id = CASES["healthy"]
    rows = rows_from_otlp(json.loads((TRACES / "healthy.otlp.json").read_text()), request_id)
    before = explain_rows(rows, request_id)
    router = next(r for r in rows if r.name == "router.generate")
    register = next(r for r in rows if r.name == "register")
    mark_us = register.start_us + 1  # the router sends the token on while the worker registers
    marked = explain_rows([*rows, SpanRow("mark", router.span_id, router.service, FIRST_TOKEN_SENT, mark_us, 0,
                                          False, {"gen_ai.request.id": request_id})], request_id)
    root_start = min(r.start_us for r in rows)
    assert marked.ttft_s == pytest.approx((mark_us - root_start) / 1e6)
    assert marked.ttft_s < before.ttft_s
    assert "prefill KV registration" in [p.label for p in before.ttft_parts]
    assert not any("registration" in p.label for p in marked.ttft_parts)
    registration = next(p for p in marked.tpot_parts if p.label == "KV registration")
    assert registration.seconds == pytest.approx((register.start_us + register.duration_us - mark_us) / 1e6)
    assert sum(p.seconds for p in marked.ttft_parts) == pytest.approx(marked.ttft_s, abs=1e-5)
    assert sum(p.seconds for p in marked.tpot_parts) == pytest.approx(
        marked.tpot_s * (marked.num_output_tokens - 1), abs=1e-5)


def test_a_prompt_served_partly_from_the_prefix_cache_says_how_much():
    document = json.loads((TRACES / "healthy.otlp.json").read_text())
    forwards = [span for resource in document["resourceSpans"] for scope in resource["scopeSpans"]
                for span in scope["spans"] if span["name"] == "forward"]
    assert forwards
    for span in forwards:
        span["attributes"].append({"key": "distserve.prefill.cached_tokens", "value": {"intValue": "1024"}})
    request_id = CASES["healthy"]
    b = explain_rows(rows_from_otlp(document, request_id), request_id)
    forward = next(p for p in b.ttft_parts if p.label == "prefill forward")
    assert "(1,024 of its tokens from the prefix cache)" in forward.detail
    assert "prefix cache" not in next(p for p in breakdown("healthy").ttft_parts if p.label == "prefill forward").detail
