"""KV transfer over UCX (ucxx): the prefill side serves, the decode side pulls.

Protocol on one endpoint, strictly request/response (one pull at a time per endpoint):
    decode -> prefill  header: 512 bytes, JSON {handle_id, request_id, secret, from_token, traceparent},
                               NUL padded
    prefill -> decode  size:   int64, the byte count to come; NOT_HELD or REFUSED (wrong secret) end it
    prefill -> decode  data:   the KV buffer itself (zero-copy from the tensor), or with from_token > 0
                               its tokens from there on ([L, 2, T - from_token, Hkv, D], one copy)
    prefill -> decode  done:   int64, once the sender's send completed (its trace span has ended)
    decode -> prefill  ack:    int64, ACK_RECEIVED once the bytes are in place and passed the checksum,
                               ACK_CORRUPT when they did not (the sender keeps the buffer for a re-pull)
The sender frees the buffer on ACK_RECEIVED.

The receiver keeps up to MAX_ENDPOINTS_PER_PEER endpoints per peer; a pull takes an idle one or opens
a new one, so pulls of different handles from one peer run side by side and a stalled pull holds only
its own endpoint. Every wait of a pull (for an endpoint slot, to connect, for bytes) lies inside its
timeout; an endpoint that saw any failure is aborted at once (cancelling receives still posted into the
caller's buffer) and never reused, and the next pull opens a new one.

A sender serves at most MAX_SERVED_ENDPOINTS endpoints and aborts a new one beyond them; a new
endpoint must send its first header within FIRST_HEADER_TIMEOUT_S (a pooled one may idle between pulls).

Binding: the sender listens on the host it is given (the worker's advertised one) through
distserve.transfer.bound_listener, since ucxx 0.52's own listener takes a port only and binds every
interface; only where that extension cannot be built (no compiler) does it fall back to ucxx's, and
says so. Either way, a sender given a peer policy (distserve.transfer.kv_peers) refuses, before reading
a byte, connections that arrived on another address than the advertised one or that come from no
registered puller; each pull is then authorized by its per-request secret.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import weakref
from typing import Awaitable, Callable

import numpy as np
import torch

from distserve import tracing
from distserve.transfer.checksum import ChunkChecksums, byte_view, pulled_intact
from distserve.transfer.connector import (Authorize, ChecksumMismatch, PullRefused, TransferCounters,
                                          TransferError)
from distserve.transfer import bound_listener, ucx_devices
from distserve.transfer.kv_peers import WILDCARD_HOSTS
from distserve.transfer.ucx_addresses import EndpointAddresses, endpoint_addresses

log = logging.getLogger(__name__)

AdmitPeer = Callable[[EndpointAddresses | None], Awaitable[str | None]]

HEADER_BYTES = 512
NOT_HELD, REFUSED = -1, -2
ACK_CORRUPT, ACK_RECEIVED = 0, 1
SERVE_TIMEOUT_S = 60.0  # the sender gives up on a puller that stops reading or acknowledging
CONNECT_TIMEOUT_S = 5.0  # how long a pre-connect waits (the connect itself goes on: KvReceiver._connecting)
MAX_ENDPOINTS_PER_PEER = 8
# The sender serves at most this many endpoints at once (32 decode workers, each with a full pool of
# MAX_ENDPOINTS_PER_PEER): a flood of connections is turned away at the door, not served a coroutine each.
MAX_SERVED_ENDPOINTS = 256
FIRST_HEADER_TIMEOUT_S = 10.0  # a new endpoint that asks for nothing in this long is closed
TURN_AWAY_LOG_S = 5.0  # at most one log line per this long about connections turned away


def _encode_header(handle_id: str, request_id: str, secret: str, from_token: int = 0) -> np.ndarray:
    trace_context = {k: v for k, v in tracing.inject_headers({}).items() if k == "traceparent"}  # fixed size
    raw = json.dumps({"handle_id": handle_id, "request_id": request_id, "secret": secret,
                      "from_token": from_token, **trace_context}).encode()
    if len(raw) > HEADER_BYTES:
        raise TransferError(f"transfer header of {len(raw)} bytes exceeds {HEADER_BYTES}")
    header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    header[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return header


def _decode_header(header: np.ndarray) -> dict:
    return json.loads(bytes(header).rstrip(b"\0").decode())


def _int64(value: int) -> np.ndarray:
    return np.array([value], dtype=np.int64)


def _transfer_attributes(num_bytes: int, seconds: float) -> dict:
    return {"distserve.kv.bytes": num_bytes, "distserve.kv.transfer_seconds": seconds,
            "distserve.kv.transfer_gbps": num_bytes / max(seconds, 1e-9) / 1e9,
            "network.transport": "ucx", "distserve.ucx.tls": os.environ.get("UCX_TLS", "default")}


# UCX settings applied unless the environment sets them. put_zcopy rendezvous measured 1.0-1.7 GB/s
# against 0.55-0.72 GB/s for UCX's default on 64 MiB loopback pulls (benchmarks/ucx_bandwidth.py).
# UCXPY_ENABLE_PYTHON_FUTURE: without it ucxx completes every pending request by polling the event
# loop (`await asyncio.sleep(0)` in a loop), so a prefill worker with an idle pre-connected endpoint
# spun its core at 100% and starved its own forward pass; with it a notifier thread wakes the loop.
UCX_DEFAULTS = {"UCX_RNDV_SCHEME": "put_zcopy", "UCX_WARN_UNUSED_ENV_VARS": "n", "UCXPY_ENABLE_PYTHON_FUTURE": "1"}


# How long ucxx's progress thread sleeps in epoll_wait with nothing to do. ucxx's own thread mode
# hard-codes 1 ms: 1,000 wake-ups a second on the worker's one pinned core, 3% of it idle and ~9%
# (0.6 core-s in a 6.9 s bf16 rate-inf bench, per process) under load, taken from the forward pass.
# Nothing waits for the timeout: every submission signals the worker (ucp_worker_signal) and every
# completion fires the worker's event fd, so it only bounds how late a lost wake-up is noticed.
PROGRESS_IDLE_WAKE_MS = 100


def _ucxx():
    # Imported lazily: only processes that move KV load UCX (the broker never does).
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import ucxx

    _wake_progress_thread_less_often()
    return ucxx


def _wake_progress_thread_less_often() -> None:
    """Makes ucxx start its progress thread with PROGRESS_IDLE_WAKE_MS rather than 1 ms (idempotent).
    ucxx picks the thread's class from application_context's namespace when progress first starts."""
    from ucxx._lib_async import application_context, continuous_ucx_progress

    if getattr(application_context.ThreadMode, "distserve_wake_ms", None) == PROGRESS_IDLE_WAKE_MS:
        return

    class ThreadModeWakingLess(continuous_ucx_progress.ProgressTask):
        distserve_wake_ms = PROGRESS_IDLE_WAKE_MS

        def __init__(self, worker, event_loop, polling_mode: bool = False):
            super().__init__(worker, event_loop)
            worker.set_progress_thread_start_callback(continuous_ucx_progress._create_context)
            worker.start_progress_thread(polling_mode=polling_mode, epoll_timeout=PROGRESS_IDLE_WAKE_MS)
            weakref.finalize(self, worker.stop_progress_thread)

    application_context.ThreadMode = ThreadModeWakingLess


_initialized = False


def init_ucx(advertise_host: str = "") -> None:
    """Loads UCX and creates its context now (~0.5 s) rather than inside the first transfer. Idempotent:
    the first call decides. advertise_host: UCX then uses only the interface holding it
    (distserve.transfer.ucx_devices; "": every interface)."""
    global _initialized
    if not _initialized:
        ucx_devices.restrict_to_advertised(advertise_host)
        _ucxx().init()
        _initialized = True


def stop_ucx() -> None:
    """Stops ucxx's notifier thread, a non-daemon thread: a process that loaded UCX calls this as it
    ends, after its last transfer, or its interpreter waits for that thread forever. Idempotent."""
    if _initialized:
        _ucxx().stop_notifier_thread()


class KvSender:
    """Serves KV buffers held by this worker to decode workers that ask by handle id."""

    def __init__(self, lookup: Callable[[str], torch.Tensor | None], on_sent: Callable[[str, int, float], None],
                 authorize: Authorize | None = None, max_endpoints: int = MAX_SERVED_ENDPOINTS,
                 first_header_timeout_s: float = FIRST_HEADER_TIMEOUT_S, admit_peer: AdmitPeer | None = None) -> None:
        """lookup(handle_id) gives the buffer to send; authorize(handle_id, secret) admits a puller (None:
        all); on_sent(handle_id, bytes, seconds) follows the puller's ACK_RECEIVED. At most max_endpoints
        are served at once; a new one that sends no header in first_header_timeout_s is closed.
        admit_peer(addresses) -> None or why a new connection is refused (KvPeerPolicy.admits; None: all)."""
        self._admit_peer = admit_peer
        self._max_endpoints = max_endpoints
        self._first_header_timeout_s = first_header_timeout_s
        self._lookup = lookup
        self._on_sent = on_sent
        self._authorize = authorize
        self._listener = None
        self._num_endpoints = 0
        self.counters = TransferCounters()
        self.num_turned_away = 0  # endpoints aborted: over the cap, refused by admit_peer, or no header in time
        self._turn_away_logged: dict[str, float] = {}  # reason -> when last logged (_turn_away)

    def start(self, port: int = 0, host: str = "") -> int:
        """Listens on host:port (port 0: any free one; host "" or a wildcard: every interface) and returns
        the port. Call it inside the running event loop."""
        init_ucx(host)
        if host not in WILDCARD_HOSTS:
            self._listener = bound_listener.create_listener(host, port, self._serve_endpoint)
            if self._listener is None:
                log.warning("the KV sender listens on every interface, not only %s (module docstring)", host)
        if self._listener is None:
            self._listener = _ucxx().create_listener(self._serve_endpoint, port=port)
        return self._listener.port

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve_endpoint(self, ep) -> None:
        if self._num_endpoints >= self._max_endpoints:
            self._turn_away(f"{self._max_endpoints} endpoints served already")
            ep.abort()
            return
        self._num_endpoints += 1  # counted while the peer is checked, so a flood stays bounded there too
        header = np.empty(HEADER_BYTES, dtype=np.uint8)
        # A pull's bytes when they are a copy (a partial pull): kept alive here until the endpoint is
        # aborted, since a send cancelled with its coroutine may still be posted from them.
        sending: list[np.ndarray] = []
        try:
            if self._admit_peer is not None and (refused := await self._admit_peer(
                    endpoint_addresses(ep.ucp_endpoint))) is not None:
                self._turn_away(refused)
                return
            try:
                await asyncio.wait_for(ep.recv(header), self._first_header_timeout_s)
            except TimeoutError:
                self._turn_away(f"no header in {self._first_header_timeout_s:g} s")
                return
            while True:
                # A puller that stops reading or acknowledging must not hold this endpoint (or the buffer) forever.
                await asyncio.wait_for(self._serve_one(ep, _decode_header(header), sending), SERVE_TIMEOUT_S)
                sending.clear()  # sent and acknowledged
                await ep.recv(header)  # the next pull on this endpoint (the receiver pools it)
        except asyncio.CancelledError:  # listener shutting down
            pass
        except Exception as exc:  # a closed peer ends its loop; nothing else depends on it
            if not ep.closed:
                log.warning("kv sender endpoint error: %r", exc)
        finally:
            self._num_endpoints -= 1
            ep.abort()  # cancels any send still posted from a buffer this coroutine no longer holds
            sending.clear()

    def _turn_away(self, reason: str) -> None:
        """Counts a connection turned away; logs each reason (which names the peer's address where it is
        the cause) at most once per TURN_AWAY_LOG_S, so that a flood cannot flood the log."""
        self.num_turned_away += 1
        now = time.monotonic()
        if now - self._turn_away_logged.get(reason, float("-inf")) >= TURN_AWAY_LOG_S:
            if len(self._turn_away_logged) >= 1024:  # many strangers: forget, rather than grow
                self._turn_away_logged.clear()
            self._turn_away_logged[reason] = now
            log.warning("kv sender: a connection is turned away: %s (%d turned away in all)", reason,
                        self.num_turned_away)

    async def _serve_one(self, ep, fields: dict, sending: list[np.ndarray]) -> None:
        handle_id = fields["handle_id"]
        tensor = self._lookup(handle_id)
        if tensor is None:
            await ep.send(_int64(NOT_HELD))
            return
        if self._authorize is not None and not self._authorize(handle_id, str(fields.get("secret", ""))):
            log.warning("kv handle=%s pull refused: the puller did not present its kv_secret", handle_id)
            await ep.send(_int64(REFUSED))
            return
        from_token = int(fields.get("from_token", 0))
        if not 0 <= from_token < tensor.shape[2]:
            await ep.send(_int64(NOT_HELD))  # no such part: the puller's layout is not this buffer's
            return
        data = byte_view(tensor if from_token == 0 else tensor[:, :, from_token:].contiguous())
        sending.append(data)
        # The span is a child of the receiver's; "done" follows its end, and the receiver waits
        # for "done", so the span always ends within its parent.
        with tracing.remote_context(fields), tracing.span("kv_transfer.send", fields.get("request_id", ""),
                                                          **{"distserve.kv.handle_id": handle_id}) as span:
            started = time.perf_counter()
            await ep.send(_int64(data.nbytes))
            await ep.send(data)
            seconds = time.perf_counter() - started
            span.set_attributes(_transfer_attributes(data.nbytes, seconds))
        await ep.send(_int64(1))
        ack = np.empty(1, dtype=np.int64)
        await ep.recv(ack)
        if int(ack[0]) != ACK_RECEIVED:
            log.warning("kv handle=%s failed the puller's checksum; kept for a second pull", handle_id)
            return
        self.counters.num_transfers += 1
        self.counters.num_bytes += data.nbytes
        self._on_sent(handle_id, data.nbytes, seconds)


@dataclasses.dataclass
class _Peer:
    """The receiver's endpoints to one prefill worker: idle ones, the one being opened, and slots
    bounding how many pulls use it at once."""

    idle: list = dataclasses.field(default_factory=list)
    num_busy: int = 0
    connecting: asyncio.Future | None = None
    slots: asyncio.Semaphore = dataclasses.field(default_factory=lambda: asyncio.Semaphore(MAX_ENDPOINTS_PER_PEER))

    @property
    def is_open(self) -> bool:
        """An endpoint is in use, or idle and not closed by the peer (which may have refused it)."""
        return bool(self.num_busy) or any(not ep.closed for ep in self.idle)


class KvReceiver:
    """Pulls KV buffers from prefill workers into caller-provided tensors."""

    def __init__(self) -> None:
        self._peers: dict[str, _Peer] = {}
        self.counters = TransferCounters()

    async def fetch(self, address: str, handle_id: str, out: torch.Tensor, timeout_s: float,
                    request_id: str = "", secret: str = "", crc32c: int | ChunkChecksums | None = None,
                    from_token: int = 0) -> float:
        """Fills `out` (contiguous, CPU) with the handle's bytes (its tokens from from_token on) within
        timeout_s; returns seconds spent. Raises TransferError (PullRefused, ChecksumMismatch) on any
        failure, a timeout included."""
        with tracing.span("kv_transfer.recv", request_id, **{"distserve.kv.handle_id": handle_id,
                                                              "distserve.kv.peer": address}) as span:
            header = _encode_header(handle_id, request_id, secret, from_token)  # in the span: its traceparent
            start = time.perf_counter()
            try:
                await asyncio.wait_for(self._pull_verified(address, handle_id, header, out, crc32c, from_token),
                                       timeout_s)
            except TransferError:
                raise
            except TimeoutError as exc:
                raise TransferError(f"fetch of {handle_id} from {address} timed out after {timeout_s:g} s") from exc
            except Exception as exc:
                raise TransferError(f"fetch of {handle_id} from {address} failed: {exc!r}") from exc
            seconds = time.perf_counter() - start
            span.set_attributes(_transfer_attributes(out.numel() * out.element_size(), seconds))
            return seconds

    async def connect(self, address: str) -> None:
        """Opens an endpoint to a peer ahead of its first transfer (set-up costs ~0.3 s), if none is open."""
        peer = self._peers.setdefault(address, _Peer())
        if peer.is_open:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._connecting(address, peer)), CONNECT_TIMEOUT_S)
        except Exception as exc:  # the peer may be gone or stalled; the next fetch retries
            log.debug("pre-connect to %s failed: %r", address, exc)

    @property
    def peers(self) -> set[str]:
        """Addresses with an open endpoint (one the peer closed, say refusing it, is not open)."""
        return {address for address, peer in self._peers.items() if peer.is_open}

    async def _pull_verified(self, address: str, handle_id: str, header: np.ndarray, out: torch.Tensor,
                             crc32c: int | ChunkChecksums | None, from_token: int) -> None:
        for attempt in (1, 2):
            if await self._pull(address, handle_id, header, out, crc32c, from_token):
                self.counters.num_transfers += 1
                self.counters.num_bytes += out.numel() * out.element_size()
                return
            log.warning("kv handle=%s from %s failed its checksum (pull %d of 2)", handle_id, address, attempt)
        raise ChecksumMismatch(f"fetch of {handle_id} from {address}: KV checksum mismatch on two pulls")

    async def _pull(self, address: str, handle_id: str, header: np.ndarray, out: torch.Tensor,
                    crc32c: int | ChunkChecksums | None, from_token: int) -> bool:
        """One pull on an endpoint no other pull is using; True when the bytes passed the checksum."""
        peer = self._peers.setdefault(address, _Peer())
        async with peer.slots:
            ep = await self._idle_or_new_endpoint(address, peer)
            peer.num_busy += 1
            try:
                verified = await _exchange(ep, handle_id, header, out, crc32c, from_token)
            except BaseException:
                # Any failure, cancellation included, can leave the endpoint mid-protocol, with a receive
                # into `out` still posted: abort it now (cancelling that receive) and never reuse it.
                ep.abort()
                raise
            finally:
                peer.num_busy -= 1
            peer.idle.append(ep)
            return verified

    async def _idle_or_new_endpoint(self, address: str, peer: _Peer):
        while True:
            ep = _take_idle(peer)
            if ep is not None:
                return ep
            await asyncio.shield(self._connecting(address, peer))

    def _connecting(self, address: str, peer: _Peer) -> asyncio.Future:
        """The peer's one endpoint being opened, which lands in its idle list. Opening is never cancelled
        (callers wait through asyncio.shield) and has no timeout of its own: ucxx leaves the peer-info
        receive of an abandoned connect posted, and a stalled peer's late answer would land in freed
        memory. A connect to a stalled peer stays pending, one per peer, while pulls waiting on it time out."""
        if peer.connecting is None:
            peer.connecting = asyncio.ensure_future(_open_into(address, peer))
            peer.connecting.add_done_callback(_log_connect_failure)
        return peer.connecting

    async def close(self) -> None:
        """Aborts the idle endpoints (in-flight pulls abort their own as they end)."""
        for peer in self._peers.values():
            while peer.idle:
                peer.idle.pop().abort()


def _take_idle(peer: _Peer):
    while peer.idle:
        ep = peer.idle.pop()
        if not ep.closed:
            return ep
    return None


async def _open_into(address: str, peer: _Peer) -> None:
    host, _, port = address.rpartition(":")
    try:
        peer.idle.append(await _ucxx().create_endpoint(host, int(port), connect_timeout=None))
    finally:
        peer.connecting = None


def _log_connect_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("connect failed: %r", future.exception())


async def _exchange(ep, handle_id: str, header: np.ndarray, out: torch.Tensor, crc32c: int | ChunkChecksums | None,
                    from_token: int) -> bool:
    """The receiver's side of one pull (module docstring); True when the bytes passed the checksum."""
    await ep.send(header)
    size = np.empty(1, dtype=np.int64)
    await ep.recv(size)
    target = byte_view(out)
    if int(size[0]) == NOT_HELD:
        raise TransferError(f"{handle_id}: not held by the sender (released or its lease expired)")
    if int(size[0]) == REFUSED:
        raise PullRefused(f"{handle_id}: pull refused by the sender: wrong or missing kv_secret")
    if int(size[0]) != target.nbytes:
        raise TransferError(f"{handle_id}: sender has {int(size[0])} bytes, expected {target.nbytes}")
    await ep.recv(target)
    await ep.recv(np.empty(1, dtype=np.int64))  # done
    verified = pulled_intact(out, crc32c, from_token)
    await ep.send(_int64(ACK_RECEIVED if verified else ACK_CORRUPT))
    return verified
