"""Which worker failures the router makes up for by moving the request (migration)."""

from __future__ import annotations

import grpc
import pytest

from distserve.registry import WorkerRecord
from services.router.stage_failure import StageFailed

WORKER = WorkerRecord("w", "decode", "w:1")
Code = grpc.StatusCode


@pytest.mark.parametrize("stage, code, retryable", [
    ("prefill", Code.UNAVAILABLE, True),           # unreachable or died: another prefill worker
    ("prefill", Code.RESOURCE_EXHAUSTED, False),   # full: the client hears 429
    ("prefill", Code.FAILED_PRECONDITION, False),  # the broker is down: no worker can help
    ("prefill", Code.INVALID_ARGUMENT, False),
    ("decode", Code.UNAVAILABLE, True),            # died mid-stream
    ("decode", Code.DATA_LOSS, True),              # KV not delivered (owner gone, stalled, bad checksum)
    ("decode", Code.ABORTED, True),                # claim failed or preempted
    ("decode", Code.NOT_FOUND, True),              # handle gone
    ("decode", Code.DEADLINE_EXCEEDED, True),      # silent past the idle timeout
    ("decode", Code.RESOURCE_EXHAUSTED, False),
    ("decode", Code.FAILED_PRECONDITION, False),   # layout mismatch: a configuration error
    ("colocated", Code.UNAVAILABLE, True),         # died: the request moves to a prefill/decode pair
    ("colocated", Code.RESOURCE_EXHAUSTED, False),
    ("colocated", Code.INVALID_ARGUMENT, False),
])
def test_retryable_failures(stage, code, retryable):
    failure = StageFailed(code, "details", WORKER, stage)
    assert failure.retryable is retryable
    assert str(failure) == f"{stage} worker w: details"
