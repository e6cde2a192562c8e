"""KV transfer over UCX (ucxx): the prefill side serves, the decode side pulls.

Protocol on one endpoint, strictly request/response (the receiver serialises
its fetches per peer with a lock, so messages never interleave):
    decode -> prefill  header: 512 bytes, JSON {handle_id, request_id, traceparent}, NUL padded
    prefill -> decode  size:   int64, the buffer's byte count, or -1 if unknown
    prefill -> decode  data:   the KV buffer itself (zero-copy from the tensor)
    prefill -> decode  done:   int64, once the sender's send completed (its trace span has ended)
    decode -> prefill  ack:    int64, 1 once the bytes are in place
The sender frees the buffer on the ack. Endpoints are kept per peer and
re-created after an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Callable

import numpy as np
import torch

from distserve import tracing
from distserve.transfer.connector import TransferCounters, TransferError

log = logging.getLogger(__name__)

HEADER_BYTES = 512
ACK_TIMEOUT_S = 60.0


def _encode_header(handle_id: str, request_id: str) -> np.ndarray:
    trace_context = {k: v for k, v in tracing.inject_headers({}).items() if k == "traceparent"}  # fixed size
    raw = json.dumps({"handle_id": handle_id, "request_id": request_id, **trace_context}).encode()
    if len(raw) > HEADER_BYTES:
        raise ValueError(f"transfer header of {len(raw)} bytes exceeds {HEADER_BYTES}")
    header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    header[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return header


def _decode_header(header: np.ndarray) -> dict[str, str]:
    return json.loads(bytes(header).rstrip(b"\0").decode())


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


def _ucxx():
    # Imported lazily: only processes that move KV load UCX (the broker never does).
    for key, value in UCX_DEFAULTS.items():
        os.environ.setdefault(key, value)
    import ucxx

    return ucxx


_initialized = False


def init_ucx() -> None:
    """Loads UCX and creates its context now (~0.5 s) rather than inside the first transfer. Idempotent."""
    global _initialized
    if not _initialized:
        _ucxx().init()
        _initialized = True


def stop_ucx() -> None:
    """Stops ucxx's notifier thread, a non-daemon thread: a process that loaded UCX calls this as it
    ends, after its last transfer, or its interpreter waits for that thread forever. Idempotent."""
    if _initialized:
        _ucxx().stop_notifier_thread()


def _as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a contiguous CPU tensor, for any dtype (bf16 included)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class KvSender:
    """Serves KV buffers held by this worker to decode workers that ask by handle id."""

    def __init__(
        self,
        lookup: Callable[[str], torch.Tensor | None],
        on_sent: Callable[[str, int, float], None],
    ) -> None:
        """lookup(handle_id) gives the buffer to send; on_sent(handle_id, bytes, seconds) follows the ack."""
        self._lookup = lookup
        self._on_sent = on_sent
        self._listener = None
        self.counters = TransferCounters()

    def start(self, port: int = 0) -> int:
        init_ucx()
        self._listener = _ucxx().create_listener(self._serve_endpoint, port=port)
        return self._listener.port

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def _serve_endpoint(self, ep) -> None:
        header = np.empty(HEADER_BYTES, dtype=np.uint8)
        try:
            while True:
                await ep.recv(header)
                await self._serve_one(ep, _decode_header(header))
        except asyncio.CancelledError:  # listener shutting down
            pass
        except Exception as exc:  # a closed peer ends its loop; nothing else depends on it
            if not ep.closed:
                log.warning("kv sender endpoint error: %s", exc)
        finally:
            if not ep.closed:
                await ep.close()

    async def _serve_one(self, ep, fields: dict[str, str]) -> None:
        handle_id = fields["handle_id"]
        tensor = self._lookup(handle_id)
        if tensor is None:
            await ep.send(np.array([-1], dtype=np.int64))
            return
        data = _as_bytes(tensor)
        # The span is a child of the receiver's; "done" follows its end, and the receiver waits
        # for "done", so the span always ends within its parent.
        with tracing.remote_context(fields), tracing.span("kv_transfer.send", fields["request_id"],
                                                          **{"distserve.kv.handle_id": handle_id}) as span:
            started = time.perf_counter()
            await ep.send(np.array([data.nbytes], dtype=np.int64))
            await ep.send(data)
            seconds = time.perf_counter() - started
            span.set_attributes(_transfer_attributes(data.nbytes, seconds))
        await ep.send(np.array([1], dtype=np.int64))
        ack = np.empty(1, dtype=np.int64)
        await asyncio.wait_for(ep.recv(ack), ACK_TIMEOUT_S)  # a stuck peer must not hold this endpoint forever
        self.counters.num_transfers += 1
        self.counters.num_bytes += data.nbytes
        self._on_sent(handle_id, data.nbytes, seconds)


class KvReceiver:
    """Pulls KV buffers from prefill workers into caller-provided tensors."""

    def __init__(self) -> None:
        self._endpoints: dict[str, object] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closing: set[asyncio.Future] = set()
        self.counters = TransferCounters()

    async def fetch(self, address: str, handle_id: str, out: torch.Tensor, timeout_s: float,
                    request_id: str = "") -> float:
        """Fills `out` (contiguous, CPU) with the handle's bytes; returns seconds spent."""
        with tracing.span("kv_transfer.recv", request_id, **{"distserve.kv.handle_id": handle_id,
                                                              "distserve.kv.peer": address}) as span:
            seconds = await self._fetch(address, handle_id, out, timeout_s, request_id)
            span.set_attributes(_transfer_attributes(out.numel() * out.element_size(), seconds))
            return seconds

    async def _fetch(self, address: str, handle_id: str, out: torch.Tensor, timeout_s: float,
                     request_id: str) -> float:
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            start = time.perf_counter()
            try:
                await asyncio.wait_for(self._fetch_locked(address, handle_id, out, request_id), timeout_s)
            except BaseException as exc:
                # Any failure, cancellation included, can leave the endpoint mid-protocol: the next
                # fetch would read this one's leftover messages. Nobody may reuse it.
                self._discard(address)
                if isinstance(exc, TransferError) or not isinstance(exc, Exception):
                    raise
                raise TransferError(f"fetch of {handle_id} from {address} failed: {exc!r}") from exc
            return time.perf_counter() - start

    async def connect(self, address: str) -> None:
        """Opens the endpoint to a peer ahead of its first transfer (set-up costs ~0.3 s)."""
        async with self._locks.setdefault(address, asyncio.Lock()):
            try:
                await self._endpoint(address)
            except Exception as exc:  # the peer may be gone; the next fetch retries
                log.debug("pre-connect to %s failed: %s", address, exc)

    @property
    def peers(self) -> set[str]:
        return set(self._endpoints)

    async def _fetch_locked(self, address: str, handle_id: str, out: torch.Tensor, request_id: str) -> None:
        ep = await self._endpoint(address)
        await ep.send(_encode_header(handle_id, request_id))
        size = np.empty(1, dtype=np.int64)
        await ep.recv(size)
        target = _as_bytes(out)
        if int(size[0]) != target.nbytes:
            raise TransferError(f"{handle_id}: sender has {int(size[0])} bytes, expected {target.nbytes}")
        await ep.recv(target)
        done = np.empty(1, dtype=np.int64)
        await ep.recv(done)
        await ep.send(np.array([1], dtype=np.int64))
        self.counters.num_transfers += 1
        self.counters.num_bytes += target.nbytes

    async def _endpoint(self, address: str):
        ep = self._endpoints.get(address)
        if ep is None or ep.closed:
            host, _, port = address.rpartition(":")
            ep = await _ucxx().create_endpoint(host, int(port))
            self._endpoints[address] = ep
        return ep

    def _discard(self, address: str) -> None:
        """Forgets the endpoint at once (synchronously, so no fetch can pick it up) and closes it later."""
        ep = self._endpoints.pop(address, None)
        if ep is not None and not ep.closed:
            task = asyncio.ensure_future(_close_endpoint(ep, address))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for address in list(self._endpoints):
            self._discard(address)
        if self._closing:
            await asyncio.wait(list(self._closing))


async def _close_endpoint(ep, address: str) -> None:
    try:
        await ep.close()
    except Exception as exc:  # already broken; closing is best effort
        log.debug("closing endpoint %s: %s", address, exc)
