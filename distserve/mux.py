"""Many server-streaming gRPC calls over one bidirectional stream, for the hops that carry every token.

grpc.aio spends most of a streamed token's CPU on its per-message machinery (callbacks, the completion
queue), not on the bytes. A decode worker streaming one message per token per request to the router pays
it once per token on each side. Here one session stream per client and server carries every call between
them, and each message is a batch of frames (mux.proto): while a write is in flight, frames pile up and
leave together in the next, so an engine step's tokens for all its requests cost one message.

Server: `MuxServer(handler, request_type)`. Its `serve(request_iterator, context)` is the body of a
stream-stream method; each open frame runs `handler(request, sub_context)`, an ordinary server-streaming
handler (an async generator) as written for its unary-stream RPC. Its sub-context's abort() ends that
call alone with the status; an unexpected error ends it with INTERNAL; a cancel frame cancels it.

Client: `MuxClient(open_session, response_type)`; `call(request, metadata, timeout)` returns a MuxCall,
read like grpc.aio's call: `await read()` gives the next response or grpc.aio.EOF and raises
grpc.aio.AioRpcError with the server's status; cancel() leaves. When the session breaks, every call in it
fails with UNAVAILABLE and the next call opens a new session.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from distserve.v1 import mux_pb2

log = logging.getLogger(__name__)


class MuxAbort(Exception):
    """Raised by a sub-context's abort(): ends one call with its status, as grpc.aio's abort ends a call."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class SubContext:
    """What a handler sees of its call inside a session: the call's own metadata, the session's peer."""

    def __init__(self, session_context, metadata: dict[str, str]):
        self._session = session_context
        self._metadata = tuple(metadata.items())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict:
        return self._session.auth_context()

    def peer(self) -> str:
        return self._session.peer()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise MuxAbort(code, details)


class MuxServer:
    """Runs each call opened in a session as `handler(request, SubContext)`; see the module docstring."""

    def __init__(self, handler: Callable, request_type):
        self._handler = handler
        self._request_type = request_type
        self.num_batches = 0  # messages sent, over all sessions
        self.num_frames = 0  # frames in them
        self.draining = False
        self._sessions: set[_ServerSession] = set()

    @classmethod
    def methods(cls, handler: Callable, request_type) -> tuple[Callable, Callable[[], None]]:
        """(the stream-stream method serving handler's calls in sessions, the drain to call when the server
        stops): what a servicer assigns to its *Mux method and its on_stop."""
        server = cls(handler, request_type)
        return server.serve, server.drain

    def drain(self) -> None:
        """The server is stopping: calls opened from now on end at once with UNAVAILABLE (the client moves
        them elsewhere), and each session ends when its last call has, instead of when the grace runs out."""
        self.draining = True
        for session in self._sessions:
            session.wake()

    async def serve(self, request_iterator: AsyncIterator[mux_pb2.MuxBatch], context) -> AsyncIterator[mux_pb2.MuxBatch]:
        session = _ServerSession(self, context)
        self._sessions.add(session)
        reader = asyncio.ensure_future(session.read(request_iterator))
        try:
            async for batch in session.batches(reader):
                yield batch
        finally:
            self._sessions.discard(session)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.UsageError):
                await reader  # the client's side ended: closed, cancelled or broken
            await session.stop()


class _ServerSession:
    def __init__(self, server: MuxServer, context):
        self._server = server
        self._context = context
        self._calls: dict[int, asyncio.Task] = {}
        self._outbox: list[mux_pb2.MuxFrame] = []
        self._ready = asyncio.Event()

    async def read(self, request_iterator) -> None:
        """Opens and cancels calls as the client asks, until it closes its side."""
        async for batch in request_iterator:
            for frame in batch.frames:
                kind = frame.WhichOneof("kind")
                if kind == "open" and self._server.draining:
                    self._send(mux_pb2.MuxFrame(stream_id=frame.stream_id, end=mux_pb2.MuxStatus(
                        code=grpc.StatusCode.UNAVAILABLE.value[0], details="the worker is shutting down")))
                elif kind == "open":
                    request = self._server._request_type.FromString(frame.open)
                    self._calls[frame.stream_id] = asyncio.ensure_future(
                        self._run(frame.stream_id, request, dict(frame.metadata)))
                elif kind == "cancel" and (task := self._calls.get(frame.stream_id)) is not None:
                    task.cancel()

    async def batches(self, reader: asyncio.Future) -> AsyncIterator[mux_pb2.MuxBatch]:
        """Everything sent since the last batch, as one message; ends when the client has closed its side
        (or broke), or when the server drains and no call is left."""
        while True:
            if not self._outbox:
                if reader.done() or (self._server.draining and not self._calls):
                    return
                waiting = asyncio.ensure_future(self._ready.wait())
                await asyncio.wait((waiting, reader), return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                self._ready.clear()
                continue  # look again: frames to send, or the session is over
            await asyncio.sleep(0)  # the other calls woken by the same engine step add theirs first
            frames, self._outbox = self._outbox, []
            self._ready.clear()
            for batch in split_batches(frames):
                self._server.num_batches += 1
                self._server.num_frames += len(batch.frames)
                yield batch

    async def _run(self, stream_id: int, request, metadata: dict[str, str]) -> None:
        status = mux_pb2.MuxStatus(code=grpc.StatusCode.OK.value[0])
        try:
            async for response in self._server._handler(request, SubContext(self._context, metadata)):
                self._send(mux_pb2.MuxFrame(stream_id=stream_id, message=response.SerializeToString()))
        except MuxAbort as abort:
            status = mux_pb2.MuxStatus(code=abort.code.value[0], details=abort.details)
        except asyncio.CancelledError:
            return  # the client cancelled it (or left): nothing to tell
        except Exception as exc:  # a bug in the handler: this call fails, the session goes on
            log.exception("mux call %d failed", stream_id)
            status = mux_pb2.MuxStatus(code=grpc.StatusCode.INTERNAL.value[0], details=f"{type(exc).__name__}: {exc}")
        finally:
            self._calls.pop(stream_id, None)
        self._send(mux_pb2.MuxFrame(stream_id=stream_id, end=status))

    def _send(self, frame: mux_pb2.MuxFrame) -> None:
        self._outbox.append(frame)
        self._ready.set()

    def wake(self) -> None:
        """Has batches() look again whether the session is over (the server began draining)."""
        self._ready.set()

    async def stop(self) -> None:
        """Cancels the calls still running (the session ended under them) and waits for them to unwind."""
        calls = list(self._calls.values())
        for task in calls:
            task.cancel()
        await asyncio.gather(*calls, return_exceptions=True)


_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
# A batch stops growing at this size, so that many large frames (long prompts opening at once, a first
# message with a prompt's logprobs) never make one message past the peer's receive cap; a larger frame
# travels alone.
MAX_BATCH_BYTES = 1 << 20


def split_batches(frames: list[mux_pb2.MuxFrame]) -> list[mux_pb2.MuxBatch]:
    """frames in order, as batches of at most MAX_BATCH_BYTES (each at least one frame)."""
    batches, current, size = [], [], 0
    for frame in frames:
        frame_size = frame.ByteSize()
        if current and size + frame_size > MAX_BATCH_BYTES:
            batches.append(mux_pb2.MuxBatch(frames=current))
            current, size = [], 0
        current.append(frame)
        size += frame_size
    if current:
        batches.append(mux_pb2.MuxBatch(frames=current))
    return batches


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class MuxCall:
    """One call in a session, read like a grpc.aio unary-stream call (read(), cancel())."""

    def __init__(self, session: "_ClientSession", stream_id: int, response_type, deadline: float | None):
        """deadline: time.monotonic() by which the call must have ended, or None."""
        self._session = session
        self._stream_id = stream_id
        self._response_type = response_type
        self._frames: asyncio.Queue = asyncio.Queue()
        self._ended = False  # cancelled, expired, or its end read
        self._end_read = False  # its end (status or failure) was returned: every later read is EOF
        # One timer for the whole call, not one per read: a streamed token costs no timer.
        self._deadline_timer = None if deadline is None else asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), self._expire)

    async def read(self):
        """The next response, or grpc.aio.EOF after the last; raises AioRpcError with the call's status."""
        if self._end_read or (self._ended and self._frames.empty()):
            return grpc.aio.EOF
        frame = await self._frames.get()
        if isinstance(frame, grpc.aio.AioRpcError):
            self._end()
            self._end_read = True
            raise frame
        if frame.WhichOneof("kind") == "message":
            return self._response_type.FromString(frame.message)
        self._end()
        self._end_read = True  # a deadline error queued behind this end is never read
        self._session.forget(self._stream_id)
        code = _STATUS_CODES.get(frame.end.code, grpc.StatusCode.UNKNOWN)
        if code != grpc.StatusCode.OK:
            raise _rpc_error(code, frame.end.details)
        return grpc.aio.EOF

    def _expire(self) -> None:
        """The deadline passed: the server stops the call, and its reader gets DEADLINE_EXCEEDED after the
        responses already here."""
        self._deadline_timer = None
        if self.cancel():
            self._frames.put_nowait(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _end(self) -> None:
        self._ended = True
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    async def code(self) -> grpc.StatusCode:
        """Waits for the call's end and returns its status code (responses not read yet are dropped)."""
        try:
            while await self.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def cancel(self) -> bool:
        """Leaves the call: the server stops it. False when it had ended already."""
        if self._ended:
            return False
        self._end()
        self._session.cancel(self._stream_id)
        return True

    def deliver(self, frame) -> None:
        """A frame (or the session's failure, as an AioRpcError) for this call, from the session's reader."""
        self._frames.put_nowait(frame)


class _ClientSession:
    """One session stream: writes opens and cancels, reads batches and hands their frames to the calls."""

    def __init__(self, stream: grpc.aio.StreamStreamCall, on_broken: Callable[["_ClientSession"], None]):
        self._stream = stream
        self._on_broken = on_broken
        self._calls: dict[int, MuxCall] = {}
        self._ids = itertools.count(1)
        self._pending: list[mux_pb2.MuxFrame] = []
        self._writing = False
        self.broken: grpc.aio.AioRpcError | None = None
        self._reader = asyncio.ensure_future(self._read())

    def open(self, request, response_type, metadata: dict[str, str], deadline: float | None) -> MuxCall:
        stream_id = next(self._ids)
        call = self._calls[stream_id] = MuxCall(self, stream_id, response_type, deadline)
        self._write(mux_pb2.MuxFrame(stream_id=stream_id, open=request.SerializeToString(), metadata=metadata))
        return call

    def cancel(self, stream_id: int) -> None:
        if self._calls.pop(stream_id, None) is not None and self.broken is None:
            self._write(mux_pb2.MuxFrame(stream_id=stream_id, cancel=True))

    def forget(self, stream_id: int) -> None:
        self._calls.pop(stream_id, None)

    def _write(self, frame: mux_pb2.MuxFrame) -> None:
        """Queues a frame; one writer task at a time sends all queued frames as one batch."""
        self._pending.append(frame)
        if not self._writing:
            self._writing = True
            asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        try:
            while self._pending and self.broken is None:
                frames, self._pending = self._pending, []
                for batch in split_batches(frames):
                    await self._stream.write(batch)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._fail(exc if isinstance(exc, grpc.aio.AioRpcError)
                       else _rpc_error(grpc.StatusCode.UNAVAILABLE, f"mux session closed: {exc}"))
        finally:
            self._writing = False

    async def _read(self) -> None:
        try:
            while (batch := await self._stream.read()) is not grpc.aio.EOF:
                for frame in batch.frames:
                    call = self._calls.get(frame.stream_id)
                    if call is not None:
                        call.deliver(frame)
            self._fail(_rpc_error(grpc.StatusCode.UNAVAILABLE, "mux session ended by the server"))
        except grpc.aio.AioRpcError as exc:
            self._fail(exc)
        except asyncio.CancelledError:
            self._fail(_rpc_error(grpc.StatusCode.CANCELLED, "mux session closed"))
            raise

    def _fail(self, error: grpc.aio.AioRpcError) -> None:
        """Every call still open fails with the session's error (UNAVAILABLE for the router's retries,
        as a broken stream would); later calls go to a new session."""
        if self.broken is not None:
            return
        code = error.code()
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            error = _rpc_error(grpc.StatusCode.UNAVAILABLE, f"mux session broke: {code.name}: {error.details()}")
        self.broken = error
        self._on_broken(self)
        for call in list(self._calls.values()):
            call.deliver(error)
        self._calls.clear()

    async def close(self) -> None:
        self._stream.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


class MuxClient:
    """Calls to one server, all in one session stream, opened on first use and again after it breaks."""

    def __init__(self, open_session: Callable[[], grpc.aio.StreamStreamCall], response_type):
        self._open_session = open_session
        self._response_type = response_type
        self._session: _ClientSession | None = None

    @staticmethod
    def fits(request) -> bool:
        """Whether request travels in a session: a larger one (a prompt of megabytes) goes as a call of its
        own, where the server's message cap answers it alone instead of breaking the session for all."""
        return request.ByteSize() <= MAX_BATCH_BYTES // 2

    def call(self, request, metadata: dict[str, str] | None = None, timeout: float | None = None) -> MuxCall:
        if self._session is None:
            self._session = _ClientSession(self._open_session(), self._dropped)
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._session.open(request, self._response_type, metadata or {}, deadline)

    def _dropped(self, session: _ClientSession) -> None:
        if self._session is session:
            self._session = None

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


class MuxSessions:
    """A MuxClient per server address, over the channel given for it (a new channel: a new client)."""

    def __init__(self, session_method: Callable[[grpc.aio.Channel], Callable[[], grpc.aio.StreamStreamCall]],
                 response_type):
        """session_method(channel): the stub's stream-stream method that opens a session on channel."""
        self._session_method = session_method
        self._response_type = response_type
        self._clients: dict[str, tuple[grpc.aio.Channel, MuxClient]] = {}

    def client(self, address: str, channel: grpc.aio.Channel) -> MuxClient:
        known = self._clients.get(address)
        if known is None or known[0] is not channel:
            known = self._clients[address] = (channel, MuxClient(self._session_method(channel), self._response_type))
        return known[1]

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for _, client in clients:
            await client.close()
