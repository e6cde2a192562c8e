"""What one client may take from the gateway: a request-rate token bucket per client, a cap on open
connections, and deadlines on reading a request (slow-loris clients hold a connection without ever
finishing their headers or body).

A client is its bearer token when it sends one (each API key is a tenant), else its address. Rate limits
are off unless configured; the connection cap and the read deadlines are always on.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from services.router.gateway.errors import ApiError

MAX_TRACKED_CLIENTS = 100_000  # buckets kept; past it, the full (idle) ones are dropped


class TokenBuckets:
    """One bucket per client: `burst` requests at once, refilled at `rate_per_s`. Not thread-safe (the
    event loop's)."""

    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic):
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate_per_s, self.burst = rate_per_s, burst
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when counted)

    def take(self, client: str) -> float:
        """Takes one request's token: 0.0 when granted, else the seconds until one is there."""
        now = self._clock()
        tokens, counted = self._buckets.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - counted) * self.rate_per_s)
        if tokens >= 1:
            self._buckets[client] = (tokens - 1, now)
            if len(self._buckets) > MAX_TRACKED_CLIENTS:
                self._drop_full(now)
            return 0.0
        self._buckets[client] = (tokens, now)
        return (1 - tokens) / self.rate_per_s

    def _drop_full(self, now: float) -> None:
        """Forgets buckets that have refilled: such a client starts full again anyway."""
        self._buckets = {client: (tokens, counted) for client, (tokens, counted) in self._buckets.items()
                         if tokens + (now - counted) * self.rate_per_s < self.burst}


def client_of(request: web.Request) -> str:
    """Whom a request counts against: its bearer token (hashed: buckets never hold keys), else its address."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip().encode()).hexdigest()[:32]
    return f"addr:{request.remote}"


def rate_limit_middleware(buckets: TokenBuckets, limited: Callable[[str], bool]) -> Callable:
    """429 with Retry-After for a client past its bucket, on the paths `limited` names."""

    @web.middleware
    async def limit_rate(request: web.Request, handler) -> web.StreamResponse:
        if limited(request.path):
            wait_s = buckets.take(client_of(request))
            if wait_s > 0:
                raise ApiError(429, f"Rate limit reached: at most {buckets.rate_per_s:g} requests per second "
                                    f"(bursts of {buckets.burst}) per API key or client address; retry in "
                                    f"{wait_s:.2f}s", type="rate_limit_error", code="rate_limit_exceeded",
                               retry_after_s=max(1, math.ceil(wait_s)))
        return await handler(request)

    return limit_rate


def body_deadline_middleware(timeout_s: float) -> Callable:
    """Reads a request's body within timeout_s, else 408; handlers' request.read() then returns it at once
    (aiohttp keeps what it read)."""

    @web.middleware
    async def read_body_in_time(request: web.Request, handler) -> web.StreamResponse:
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                raise ApiError(408, f"request body not received within {timeout_s:g}s",
                               code="request_timeout") from None
        return await handler(request)

    return read_body_in_time


class ConnectionGuard:
    """Installed on an aiohttp Server: a cap on open connections (one over it is closed at once) and a
    deadline for a new connection's first request headers (a connection that has sent none by then is
    closed). It wraps the server's public hooks (connection_made, connection_lost, request_factory)."""

    def __init__(self, server: web.Server, *, max_connections: int, header_timeout_s: float):
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.num_refused = 0
        self._open: set[RequestHandler] = set()
        self._served: set[RequestHandler] = set()  # connections that have sent a whole request's headers
        self._made, self._lost = server.connection_made, server.connection_lost
        self._make_request = server.request_factory
        server.connection_made, server.connection_lost = self._connection_made, self._connection_lost
        server.request_factory = self._make_request_guarded

    def _connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        self._made(handler, transport)
        self._open.add(handler)
        if len(self._open) > self.max_connections:
            self.num_refused += 1
            transport.close()
            return
        asyncio.get_running_loop().call_later(self.header_timeout_s, self._close_if_silent, handler, transport)

    def _connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._open.discard(handler)
        self._served.discard(handler)
        self._lost(handler, exc)

    def _make_request_guarded(self, message, payload, protocol, writer, task, *args, **kwargs):
        self._served.add(protocol)
        return self._make_request(message, payload, protocol, writer, task, *args, **kwargs)

    def _close_if_silent(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        if handler not in self._served and not transport.is_closing():
            transport.close()


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server carries a ConnectionGuard (`guard`, once set up)."""

    def __init__(self, app: web.Application, *, max_connections: int, header_timeout_s: float, **kwargs):
        super().__init__(app, **kwargs)
        self._guards = {"max_connections": max_connections, "header_timeout_s": header_timeout_s}
        self.guard: ConnectionGuard | None = None

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # aiohttp builds its Server here, after the app's startup
        self.guard = ConnectionGuard(server, **self._guards)
        return server
