"""The explanation in words: a verdict line per SLO naming the stretch to blame, then the stretches."""

from __future__ import annotations

import argparse
import json
import sys

from distserve.explain.breakdown import Breakdown, Part, explain_rows, ms
from distserve.explain.spans import TraceNotFound, rows_from_jaeger_query, rows_from_otlp

MIN_SHOWN_S = 0.0001  # stretches shorter than this are left out of the tables
BLAME_SHARE = 0.2  # a verdict names the second-largest stretch too when it holds more of the time than this


def render(b: Breakdown, slo_ttft_s: float, slo_tpot_s: float) -> str:
    lines = [f"request {b.request_id}: " + "; ".join(_verdicts(b, slo_ttft_s, slo_tpot_s))]
    if b.failure:
        lines.append(f"the request failed: {b.failure}")
    if b.ttft_parts:
        lines.append(f"time to first token, {ms(b.ttft_s)}:")
        lines += _table(b.ttft_parts, b.ttft_s)
    if b.tpot_parts:
        after_s = b.tpot_s * (b.num_output_tokens - 1)
        lines.append(f"after the first token, {ms(after_s)} for {b.num_output_tokens - 1} more tokens "
                     f"(TPOT {ms(b.tpot_s)}):")
        lines += _table(b.tpot_parts, after_s)
    for title, items in (("retries", b.retries), ("errors", b.errors)):
        if items:
            lines.append(f"{title}:")
            lines += [f"  {item}" for item in items]
    return "\n".join(lines)


def _verdicts(b: Breakdown, slo_ttft_s: float, slo_tpot_s: float) -> list[str]:
    verdicts = []
    if b.ttft_s is None:
        verdicts.append("no first token")
    else:
        verdicts.append(_verdict("TTFT", b.ttft_s, slo_ttft_s, _blame(b.ttft_parts, b.ttft_s, 0)))
    if b.tpot_s is not None:
        verdicts.append(_verdict("TPOT", b.tpot_s, slo_tpot_s,
                                 _blame(b.tpot_parts, b.tpot_s * (b.num_output_tokens - 1), b.num_output_tokens - 1)))
    if len(b.retries):
        verdicts.append(f"{len(b.retries)} retr{'y' if len(b.retries) == 1 else 'ies'}")
    verdicts.append(f"end to end {ms(b.e2e_s)} for {b.num_output_tokens} output tokens")
    return verdicts


def _verdict(name: str, seconds: float, slo_s: float, blame: str) -> str:
    """Blames a broken SLO on its stretches; a met one is only said to be met (the tables say the rest)."""
    if seconds > slo_s:
        return f"{name} {ms(seconds)} > {ms(slo_s)} SLO: {blame}"
    return f"{name} {ms(seconds)} ok (SLO {ms(slo_s)})"


def _blame(parts: list[Part], total_s: float, num_tokens: int) -> str:
    """The largest stretch, and the next one too when it holds over BLAME_SHARE of the time; with
    num_tokens, each one's share of every token's time."""
    ranked = sorted(parts, key=lambda p: -p.seconds) or [Part("nothing traced", 0.0)]
    named = ranked[:1] + [p for p in ranked[1:2] if p.seconds > BLAME_SHARE * total_s]
    share = (lambda p: f", {ms(p.seconds / num_tokens)} of every token's time") if num_tokens else (lambda p: "")
    return " and ".join(p.words + share(p) for p in named)


def _table(parts: list[Part], total_s: float) -> list[str]:
    width = max(len(p.label) for p in parts)
    return [f"  {p.label:<{width}}  {ms(p.seconds):>9}  {100 * p.seconds / max(total_s, 1e-9):3.0f}%"
            + (f"  {p.detail}" if p.detail else "") for p in parts if p.seconds >= MIN_SHOWN_S]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id")
    parser.add_argument("--otlp-file", default="", help="read the trace from this OTLP/JSON export instead of Jaeger")
    parser.add_argument("--jaeger-url", "--jaeger", default="http://127.0.0.1:16686",
                        help="Jaeger query (UI) base URL")
    parser.add_argument("--service", default="distserve-router", help="service to search the request id in (Jaeger)")
    parser.add_argument("--slo-ttft-ms", type=float, default=300.0, help="time-to-first-token SLO")
    parser.add_argument("--slo-tpot-ms", type=float, default=60.0, help="time-per-output-token SLO")


def run(args) -> int:
    """Prints the explanation; 1 with a message on stderr when the trace cannot be read or has no such request."""
    try:
        if args.otlp_file:
            with open(args.otlp_file) as f:
                rows = rows_from_otlp(json.load(f), args.request_id)
        else:
            rows = rows_from_jaeger_query(args.jaeger_url, args.request_id, args.service)
    except TraceNotFound as exc:
        print(f"error: {exc} in {args.otlp_file or args.jaeger_url}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # unreachable Jaeger, missing file, not JSON
        print(f"error: cannot read the trace from {args.otlp_file or args.jaeger_url}: {exc}", file=sys.stderr)
        return 1
    print(render(explain_rows(rows, args.request_id), args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000))
    return 0
