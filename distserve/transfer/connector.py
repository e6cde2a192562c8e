"""The KV connector seam: how a prompt's KV moves from the worker that prefilled it to the one that
decodes it. Services see only these two roles; the transports behind them are chosen by name.

Producer role (prefill side), `KvProducer`:
    start(port) -> port   serve pulls; buffers come from `lookup(handle_id)` (the worker's held KV)
    authorize(handle_id, secret) -> bool   whether a puller presenting `secret` may have the buffer
        (None: every puller may; tools and benchmarks that hold no secrets)
    on_sent(handle_id, num_bytes, seconds) is called once the consumer has the bytes, verified
    stop()
Consumer role (decode side), `KvConsumer`:
    await fetch(address, handle_id, out, timeout_s, request_id, secret, crc32c, from_token) -> seconds
        fills `out` or raises TransferError; `out` is a contiguous tensor [L, 2, T - from_token, Hkv, D]:
        the handle's tokens from from_token on (0: all; a puller holding a cached prefix pulls the rest).
        `secret` is presented to the producer (PullRefused if it does not match); with `crc32c` (the
        whole buffer's CRC32C, or its ChunkChecksums, which a pull from from_token > 0 needs) the bytes
        are verified and pulled once more on a mismatch (ChecksumMismatch if the second pull is wrong
        too). The whole fetch, waits included, ends within timeout_s.
    await connect(address)   optional warm-up of a peer; peers: the connected addresses
    await close()

Connectors (`make_producer` / `make_consumer`):
- "ucx": host-staged pulls over UCX (distserve.transfer.ucx_transfer), imported lazily so that
  processes that never move KV never load UCX.
- "local": in-process, for tests; fetch copies straight from the producer's buffer. (A colocated
  worker needs no connector at all: it writes a prompt's KV buffer straight into its paged cache.)
A CUDA (device-to-device) connector is another entry here.

Per-layer sends were measured and left out: the transfer runs after the first token is returned,
so it never adds to TTFT, and for 256-token prompts of the default model it takes 1-3 ms against a
100-200 ms prefill (docs/kv-transfer.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Protocol

import torch

from distserve.transfer.checksum import ChunkChecksums, pulled_intact

Lookup = Callable[[str], "torch.Tensor | None"]
Authorize = Callable[[str, str], bool]
OnSent = Callable[[str, int, float], None]


class TransferError(RuntimeError):
    """The KV could not be fetched; the request cannot continue on this path."""


class PullRefused(TransferError):
    """The producer holds the handle but the puller did not present its secret."""


class ChecksumMismatch(TransferError):
    """The pulled bytes did not match the handle's CRC32C, twice."""


@dataclasses.dataclass
class TransferCounters:
    num_transfers: int = 0
    num_bytes: int = 0


class KvProducer(Protocol):
    counters: TransferCounters

    def start(self, port: int = 0, host: str = "") -> int:
        """Serves on host:port (port 0: any free one; host "": every interface); returns the port."""

    def stop(self) -> None: ...


class KvConsumer(Protocol):
    counters: TransferCounters

    async def fetch(self, address: str, handle_id: str, out: torch.Tensor, timeout_s: float,
                    request_id: str = "", secret: str = "", crc32c: int | ChunkChecksums | None = None,
                    from_token: int = 0) -> float: ...

    async def connect(self, address: str) -> None: ...

    @property
    def peers(self) -> set[str]: ...

    async def close(self) -> None: ...


_local_producers: dict[int, "LocalProducer"] = {}
_local_ports = itertools.count(1)


class LocalProducer:
    """Serves buffers to LocalConsumers in the same process, addressed as local:<port>."""

    def __init__(self, lookup: Lookup, on_sent: OnSent, authorize: Authorize | None = None):
        self._lookup, self._on_sent, self._authorize = lookup, on_sent, authorize
        self.counters = TransferCounters()
        self.port = 0

    def start(self, port: int = 0, host: str = "") -> int:
        self.port = port or next(_local_ports)  # in-process: no address to bind
        _local_producers[self.port] = self
        return self.port

    def stop(self) -> None:
        _local_producers.pop(self.port, None)

    def send(self, handle_id: str, out: torch.Tensor, secret: str, crc32c: int | ChunkChecksums | None,
             from_token: int = 0) -> float:
        started = time.perf_counter()
        kv = self._lookup(handle_id)
        if kv is None:
            raise TransferError(f"{handle_id}: not held by local:{self.port}")
        if self._authorize is not None and not self._authorize(handle_id, secret):
            raise PullRefused(f"{handle_id}: pull refused by local:{self.port} (wrong kv_secret)")
        kv = kv[:, :, from_token:]
        if kv.shape != out.shape or kv.dtype != out.dtype:
            raise TransferError(f"{handle_id}: held {tuple(kv.shape)} {kv.dtype} from token {from_token}, "
                                f"expected {tuple(out.shape)} {out.dtype}")
        out.copy_(kv)
        if not pulled_intact(out, crc32c, from_token):
            raise ChecksumMismatch(f"{handle_id}: KV checksum mismatch")
        seconds = time.perf_counter() - started
        num_bytes = out.numel() * out.element_size()
        self.counters.num_transfers += 1
        self.counters.num_bytes += num_bytes
        self._on_sent(handle_id, num_bytes, seconds)
        return seconds


class LocalConsumer:
    """Pulls from LocalProducers of this process."""

    def __init__(self) -> None:
        self.counters = TransferCounters()

    async def fetch(self, address: str, handle_id: str, out: torch.Tensor, timeout_s: float,
                    request_id: str = "", secret: str = "", crc32c: int | ChunkChecksums | None = None,
                    from_token: int = 0) -> float:
        producer = _local_producers.get(int(address.rpartition(":")[2]))
        if producer is None:
            raise TransferError(f"no local producer at {address}")
        seconds = producer.send(handle_id, out, secret, crc32c, from_token)
        self.counters.num_transfers += 1
        self.counters.num_bytes += out.numel() * out.element_size()
        return seconds

    async def connect(self, address: str) -> None:
        return None

    @property
    def peers(self) -> set[str]:
        return {f"local:{port}" for port in _local_producers}

    async def close(self) -> None:
        return None


CONNECTORS = ("ucx", "local")


def make_producer(kind: str, lookup: Lookup, on_sent: OnSent, authorize: Authorize | None = None,
                  admit_peer=None) -> KvProducer:
    """The producer role of connector `kind` (one of CONNECTORS). admit_peer: which connections a network
    connector serves (ucx_transfer.KvSender's; None: all); the local one has no network."""
    if kind == "local":
        return LocalProducer(lookup, on_sent, authorize)
    if kind == "ucx":
        from distserve.transfer.ucx_transfer import KvSender

        return KvSender(lookup, on_sent, authorize, admit_peer=admit_peer)
    raise ValueError(f"kv_connector: {kind!r} is not one of {CONNECTORS}")


def make_consumer(kind: str, advertise_host: str = "") -> KvConsumer:
    """The consumer role of connector `kind` (one of CONNECTORS); a network one uses only the interface
    of advertise_host ("": any)."""
    if kind == "local":
        return LocalConsumer()
    if kind == "ucx":
        from distserve.transfer.ucx_transfer import KvReceiver, init_ucx

        init_ucx(advertise_host)
        return KvReceiver()
    raise ValueError(f"kv_connector: {kind!r} is not one of {CONNECTORS}")


def shutdown(kind: str) -> None:
    """Releases what connector `kind` keeps per process (UCX: its notifier thread); call as the process ends."""
    if kind == "ucx":
        import sys

        if "distserve.transfer.ucx_transfer" in sys.modules:  # never loads UCX just to stop it
            sys.modules["distserve.transfer.ucx_transfer"].stop_ucx()
