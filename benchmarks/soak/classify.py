"""Judging one request: completed, clear error, cancelled (by the client, as planned), or bad.

Bad is what a client must never see: a hang, an answer it cannot read, a 200
stream that ends without finish_reason and [DONE], a completion with the wrong
number of tokens, or a pool request (greedy or seeded) whose text differs from
its reference. A dropped connection is a clear error only while the gateway
itself was down (killed while the request was in flight, or not yet back).
"""

from __future__ import annotations

import re

from benchmarks.soak.client import Outcome
from benchmarks.soak.workload import Planned

_VARYING = re.compile(r"[0-9a-f]{16,}|\d+(\.\d+)*")  # request and handle ids, ports, addresses, counts

COMPLETED, CLEAR_ERROR, CANCELLED, BAD = "completed", "clear_error", "cancelled", "bad"


def classify(planned: Planned, outcome: Outcome, references: dict[str, Outcome],
             during_gateway_fault: bool) -> tuple[str, str]:
    """(class, reason): the reason names the error kind or what was wrong."""
    if outcome.hung:
        return BAD, "hang"
    if outcome.malformed:
        return BAD, f"malformed: {outcome.malformed}"
    if outcome.transport:
        if during_gateway_fault:
            return CLEAR_ERROR, "connection dropped (gateway killed)"
        return BAD, f"connection failed with no gateway fault: {outcome.transport}"
    if outcome.cancelled:
        return CANCELLED, planned.action
    if outcome.error:
        where = "SSE error event" if outcome.status == 200 else f"HTTP {outcome.status}"
        return CLEAR_ERROR, f"{where}: {_error_kind(outcome.error)}"
    if outcome.status != 200:
        return BAD, f"HTTP {outcome.status} without an error message"
    return _judge_answer(planned, outcome, references)


def _judge_answer(planned: Planned, outcome: Outcome, references: dict[str, Outcome]) -> tuple[str, str]:
    if planned.stream and not outcome.saw_done:
        return BAD, "stream ended without [DONE]"
    if outcome.finish_reason not in ("stop", "length"):
        return BAD, f"finish_reason {outcome.finish_reason!r}"
    max_tokens = planned.body["max_tokens"]
    tokens = outcome.completion_tokens
    if tokens is None or not (tokens == max_tokens if outcome.finish_reason == "length" else 0 < tokens <= max_tokens):
        return BAD, f"{tokens} completion tokens with finish_reason {outcome.finish_reason}, max_tokens {max_tokens}"
    reference = references.get(planned.reference_key)
    if reference and (outcome.text, outcome.completion_tokens) != (reference.text, reference.completion_tokens):
        return BAD, f"differs from the reference {planned.reference_key}"
    return COMPLETED, outcome.finish_reason


def _error_kind(message: str) -> str:
    """A count-friendly form of an error message: ids, addresses and numbers masked, at most 120 characters."""
    return _VARYING.sub("#", message)[:120]
