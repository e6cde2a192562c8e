"""distserve.mux: server-streaming calls multiplexed over one bidirectional gRPC stream, on a real
in-process server. The calls' handler is an ordinary async generator over DecodeRequest/DecodeResponse."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from distserve.mux import MuxClient, MuxServer
from distserve.v1 import decode_pb2, decode_pb2_grpc


class Handlers:
    """Decode-shaped handlers: request.first_token_id picks the behaviour, request_id the tokens."""

    def __init__(self):
        self.cancelled: list[str] = []
        self.metadata: dict[str, dict] = {}
        self.gate = asyncio.Event()

    async def decode(self, request, context):
        self.metadata[request.request_id] = dict(context.invocation_metadata())
        count = int(request.request_id.split("-")[1])
        try:
            for i in range(count):
                if request.first_token_id == 2:  # waits until released: a slow call
                    await self.gate.wait()
                yield decode_pb2.DecodeResponse(token_ids=[i], index=count)
            if request.first_token_id == 1:
                await context.abort(grpc.StatusCode.ABORTED, "preempted")
            if request.first_token_id == 3:
                raise RuntimeError("a bug")
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


class Servicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, handlers: Handlers):
        self._mux = handlers.mux = MuxServer(handlers.decode, decode_pb2.DecodeRequest)

    async def DecodeMux(self, request_iterator, context):
        async for batch in self._mux.serve(request_iterator, context):
            yield batch


@pytest.fixture
async def served():
    handlers = Handlers()
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(Servicer(handlers), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    client = MuxClient(decode_pb2_grpc.DecodeServiceStub(channel).DecodeMux, decode_pb2.DecodeResponse)
    yield client, handlers, server
    await client.close()
    await channel.close()
    await server.stop(0)


async def read_all(call) -> list[list[int]]:
    tokens = []
    while (message := await call.read()) is not grpc.aio.EOF:
        tokens.append(list(message.token_ids))
    return tokens


async def test_many_calls_share_one_session_and_each_gets_its_own_messages(served):
    client, handlers, _ = served
    calls = [client.call(decode_pb2.DecodeRequest(request_id=f"r-{n}"), metadata={"traceparent": f"t{n}"})
             for n in (3, 5, 1)]
    results = await asyncio.gather(*map(read_all, calls))
    assert results == [[[0], [1], [2]], [[0], [1], [2], [3], [4]], [[0]]]
    assert handlers.metadata["r-5"] == {"traceparent": "t5"}
    assert await calls[0].read() is grpc.aio.EOF  # ended stays ended


async def test_an_abort_or_a_handler_bug_ends_that_call_alone_with_its_status(served):
    client, _, _ = served
    aborted = client.call(decode_pb2.DecodeRequest(request_id="r-2", first_token_id=1))
    buggy = client.call(decode_pb2.DecodeRequest(request_id="r-1", first_token_id=3))
    fine = client.call(decode_pb2.DecodeRequest(request_id="r-2"))
    assert [list((await aborted.read()).token_ids), list((await aborted.read()).token_ids)] == [[0], [1]]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await aborted.read()
    assert error.value.code() == grpc.StatusCode.ABORTED and error.value.details() == "preempted"
    with pytest.raises(grpc.aio.AioRpcError) as bug:
        await read_all(buggy)
    assert bug.value.code() == grpc.StatusCode.INTERNAL and "a bug" in bug.value.details()
    assert await read_all(fine) == [[0], [1]]


async def test_cancel_stops_the_call_on_the_server_and_a_deadline_ends_the_read(served):
    client, handlers, _ = served
    slow = client.call(decode_pb2.DecodeRequest(request_id="r-4", first_token_id=2))
    await asyncio.sleep(0.2)
    assert slow.cancel() and not slow.cancel()
    for _ in range(50):
        if handlers.cancelled:
            break
        await asyncio.sleep(0.02)
    assert handlers.cancelled == ["r-4"]
    late = client.call(decode_pb2.DecodeRequest(request_id="r-4", first_token_id=2), timeout=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await late.read()
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await read_all(client.call(decode_pb2.DecodeRequest(request_id="r-2"))) == [[0], [1]]


async def test_a_broken_session_fails_its_calls_unavailable_and_the_next_call_opens_a_new_one(served):
    client, _, _ = served
    slow = client.call(decode_pb2.DecodeRequest(request_id="r-3", first_token_id=2))
    await asyncio.sleep(0.2)
    client._session._stream.cancel()  # the session stream breaks under the call
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await slow.read()
    assert error.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert await read_all(client.call(decode_pb2.DecodeRequest(request_id="r-2"))) == [[0], [1]]


async def test_one_engine_step_of_many_calls_leaves_in_few_messages(served):
    client, handlers, _ = served
    calls = [client.call(decode_pb2.DecodeRequest(request_id="r-1", first_token_id=2)) for _ in range(8)]
    await asyncio.sleep(0.2)
    mux = handlers.mux
    batches, frames = mux.num_batches, mux.num_frames
    handlers.gate.set()  # every call's token at once, as one decode step wakes them all
    assert await asyncio.gather(*map(read_all, calls)) == [[[0]]] * 8
    assert mux.num_frames - frames == 16  # 8 tokens and 8 ends
    assert mux.num_batches - batches <= 3  # in a few messages, not 16


async def test_a_draining_server_refuses_new_calls_and_ends_the_session_with_its_last_call(served):
    client, handlers, _ = served
    slow = client.call(decode_pb2.DecodeRequest(request_id="r-2", first_token_id=2))
    await asyncio.sleep(0.2)
    handlers.mux.drain()
    refused = client.call(decode_pb2.DecodeRequest(request_id="r-1"))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await refused.read()
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.value.details()
    session = client._session
    handlers.gate.set()
    assert await read_all(slow) == [[0], [1]]  # the call in flight finishes
    for _ in range(50):  # then the session ends: the server's stop need not wait out its grace
        if session.broken is not None:
            break
        await asyncio.sleep(0.02)
    assert session.broken is not None and client._session is None


async def test_a_deadline_passing_after_the_call_ended_unread_changes_nothing(served):
    """The end arrived before the deadline but was read after it: the reader gets the responses and EOF,
    and EOF again, never DEADLINE_EXCEEDED."""
    client, _, _ = served
    call = client.call(decode_pb2.DecodeRequest(request_id="r-2"), timeout=0.3)
    await asyncio.sleep(0.6)  # everything (2 responses and the end) is here; then the deadline passes
    assert [list((await call.read()).token_ids) for _ in range(2)] == [[0], [1]]
    assert await call.read() is grpc.aio.EOF
    assert await call.read() is grpc.aio.EOF
