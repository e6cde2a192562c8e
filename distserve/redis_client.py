"""The one way services connect to Redis: a restarted Redis is reconnected to transparently.

redis-py keeps pooled connections; after Redis restarts, the first command on each one fails
("Connection closed by server") unless the client retries connection errors, which redis-py
(8.x) does only when told which errors to retry. Commands are retried on a fresh connection
a few times with a short backoff, so a Redis restart costs callers a pause, not an error.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

RETRIES = 3
# A Redis that stops answering (paused, partitioned) fails each command within about
# (RETRIES + 1) x SOCKET_TIMEOUT_S instead of hanging registry refreshes, claims and heartbeats forever.
# A subscription's listen() is not bounded by it: it waits for messages as long as it must.
SOCKET_TIMEOUT_S = 5.0


def connect(url: str, **options) -> aioredis.Redis:
    """An asyncio Redis client for url (redis://, rediss://, passwords included); `options` are
    redis-py's (socket_timeout and socket_connect_timeout default to SOCKET_TIMEOUT_S)."""
    options.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", SOCKET_TIMEOUT_S)
    return aioredis.from_url(url, retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), RETRIES),
                             retry_on_error=[ConnectionError, TimeoutError], **options)


def raise_if_cancelled() -> None:
    """Raises CancelledError if the running task has a cancellation pending.

    redis-py (8.1) can swallow a cancellation that lands mid-command and return normally (measured:
    ~1 in 10 heartbeat tasks cancelled within 20 ms of starting ran on), so a loop of Redis calls
    cancelled during one would never end, and a worker or router shutting down would hang on it. Such
    loops call this after each Redis call."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
