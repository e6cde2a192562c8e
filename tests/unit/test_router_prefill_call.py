"""The router's side of one PrefillStream call, with fake channels and calls (the whole path, with real
workers killed and paused, is tests/faults/test_migration.py).

- A picked prefill worker counts as loaded from the pick on, while its channel connects too, so
  requests picked meanwhile go elsewhere rather than all to the worker first in line.
- A failure after the KV part arrived is no prefill failure (the KV is registered; decode's pull
  finds out); one before it is.
"""

from __future__ import annotations

import asyncio
import types

import grpc
import pytest

from distserve.registry import WorkerRecord
from distserve.v1 import prefill_pb2
from services.router.config import RouterConfig
from services.router.picker import WorkerPicker
from services.router.server import RouterServicer
from services.router.stage_failure import StageFailed


class ConnectingChannel:
    """A channel whose connect never completes (a worker just restarted, say)."""

    def get_state(self, try_to_connect: bool = False):
        return grpc.ChannelConnectivity.CONNECTING

    async def channel_ready(self):
        await asyncio.Event().wait()


class ScriptedCall:
    """A PrefillStream call that returns `parts`, then raises `error` (or ends)."""

    def __init__(self, parts, error: grpc.aio.AioRpcError | None = None):
        self._parts, self._error = list(parts), error

    async def read(self):
        if self._parts:
            return self._parts.pop(0)
        if self._error is not None:
            raise self._error
        return grpc.aio.EOF


def unavailable() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="Socket closed")


def servicer_with(picker: WorkerPicker) -> RouterServicer:
    """A router servicer with only the state its prefill call uses."""
    servicer = RouterServicer.__new__(RouterServicer)
    servicer._config = RouterConfig()
    servicer._picker = picker
    servicer._channels = types.SimpleNamespace(get=lambda address: ConnectingChannel())
    return servicer


def prefill_worker(worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id, "prefill", f"{worker_id}:1", load={"outstanding_tokens": 0})


async def test_a_prefill_worker_counts_as_loaded_while_its_channel_connects():
    first, second = prefill_worker("first"), prefill_worker("second")
    picker = WorkerPicker(registry=None, suspect_s=5.0)
    picker._workers["prefill"] = [first, second]
    request = types.SimpleNamespace(prompt=[1, 2, 3], outputs=[], request_id="r", expected_cached_tokens=0)
    assert picker.pick_prefill() is first
    attempt = servicer_with(picker)._attempt(request, first, None, "handle", "secret")
    step = asyncio.create_task(attempt.__anext__())
    await asyncio.sleep(0.05)  # connecting to `first`
    try:
        assert not step.done()
        assert picker.pick_prefill() is second
    finally:
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
    assert picker.pick_prefill() is first  # the cancelled attempt no longer counts


async def test_a_failure_after_the_kv_part_leaves_the_handle_for_decode():
    servicer = servicer_with(WorkerPicker(registry=None, suspect_s=5.0))
    first = prefill_pb2.PrefillResponse(first_token_id=7)
    call = ScriptedCall([prefill_pb2.PrefillResponse(kv_handle_id="abc")], unavailable())
    await servicer._merge_kv_part(types.SimpleNamespace(request_id="r"), call, first, prefill_worker("p"))
    assert (first.first_token_id, first.kv_handle_id) == (7, "abc")


async def test_a_failure_before_the_kv_part_is_a_retryable_prefill_failure():
    servicer = servicer_with(WorkerPicker(registry=None, suspect_s=5.0))
    first = prefill_pb2.PrefillResponse(first_token_id=7)
    with pytest.raises(StageFailed) as failed:
        await servicer._merge_kv_part(types.SimpleNamespace(request_id="r"), ScriptedCall([], unavailable()),
                                      first, prefill_worker("p"))
    assert (failed.value.stage, failed.value.code, failed.value.retryable) == (
        "prefill", grpc.StatusCode.UNAVAILABLE, True)
