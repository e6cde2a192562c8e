"""RouterAnswer: a router that fails is replaced, before any message by a fresh start on the next router,
after some by a resume from the tokens received; what cannot be resumed fails with the router's error."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from distserve.v1 import common_pb2, router_pb2
from services.router.gateway.errors import ApiError
from services.router.gateway.router_client import RouterAnswer


class FakeCall:
    """A Generate call that yields `messages`, then fails UNAVAILABLE (or ends)."""

    def __init__(self, messages: list[router_pb2.GenerateResponse], fails: bool):
        self._messages, self._fails = list(messages), fails
        self.cancelled = False

    async def read(self):
        if self._messages:
            return self._messages.pop(0)
        if self._fails:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "Socket closed")
        return grpc.aio.EOF

    def cancel(self):
        self.cancelled = True


def message(*ids: int, finish: bool = False, index: int = 0) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(token_ids=ids, index=index, finish_reason=common_pb2.FINISH_REASON_LENGTH
                                       if finish else common_pb2.FINISH_REASON_UNSPECIFIED)


def answer(calls: list[FakeCall], request: router_pb2.GenerateRequest, num_routers: int):
    started: list[tuple[router_pb2.GenerateRequest, int]] = []

    def start(attempt_request, attempt):
        started.append((attempt_request, attempt))
        return calls[attempt]
    return RouterAnswer(start, request, {}, 1, num_routers), started


async def read_all(router_answer: RouterAnswer) -> list[int]:
    ids = []
    while (m := await router_answer.next()) is not None:
        ids += m.token_ids
    return ids


def test_a_stream_cut_mid_way_resumes_from_the_tokens_received():
    request = router_pb2.GenerateRequest(request_id="r", echo=True)
    router_answer, started = answer([FakeCall([message(1), message(2, 3)], fails=True),
                                     FakeCall([message(4), message(5, finish=True)], fails=False)], request, 1)
    assert asyncio.run(read_all(router_answer)) == [1, 2, 3, 4, 5]
    resumed, attempt = started[1]
    assert attempt == 1 and list(resumed.resume_token_ids) == [1, 2, 3] and not resumed.echo
    assert resumed.request_id == "r"  # one request, one trace


@pytest.mark.parametrize("num_routers, recovers", [(1, False), (2, True)])
def test_before_any_message_only_another_router_is_tried(num_routers, recovers):
    calls = [FakeCall([], fails=True), FakeCall([message(7, finish=True)], fails=False)]
    router_answer, started = answer(calls, router_pb2.GenerateRequest(), num_routers)
    if recovers:
        assert asyncio.run(read_all(router_answer)) == [7] and not started[1][0].resume_token_ids
    else:
        with pytest.raises(ApiError) as info:
            asyncio.run(read_all(router_answer))
        assert info.value.status == 503 and len(started) == 1


def test_a_router_failing_before_any_message_leaves_the_resume_of_a_later_cut():
    """Two routers: the first is still reconnecting (fails at once), the second's stream is cut mid-way,
    and the first, back by then, finishes it from the tokens received."""
    calls = [FakeCall([], fails=True), FakeCall([message(1), message(2)], fails=True),
             FakeCall([message(3, finish=True)], fails=False)]
    router_answer, started = answer(calls, router_pb2.GenerateRequest(), 2)
    assert asyncio.run(read_all(router_answer)) == [1, 2, 3]
    assert [attempt for _, attempt in started] == [0, 1, 2]
    assert list(started[2][0].resume_token_ids) == [1, 2]


def test_several_completions_are_not_resumed_mid_way_and_each_router_is_tried_once():
    many = router_pb2.GenerateRequest(n=2)
    router_answer, started = answer([FakeCall([message(1)], fails=True), FakeCall([], fails=False)], many, 2)
    with pytest.raises(ApiError):
        asyncio.run(read_all(router_answer))
    assert len(started) == 1
    calls = [FakeCall([message(1)], fails=True), FakeCall([message(2)], fails=True), FakeCall([], fails=False)]
    router_answer, started = answer(calls, router_pb2.GenerateRequest(), 2)
    with pytest.raises(ApiError):
        asyncio.run(read_all(router_answer))
    assert len(started) == 2
