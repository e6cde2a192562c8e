"""distserve.redis_client: a Redis restart costs callers a pause, not an error (real redis-server)."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis

from distserve import redis_client
from distserve.launcher import find_redis_server
from distserve.ports import free_port


def start_redis(port: int) -> subprocess.Popen:
    process = subprocess.Popen([find_redis_server(), "--port", str(port), "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            client.ping()
            return process
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise AssertionError("redis-server did not start")


@pytest.fixture
def redis_port():
    port = free_port()
    process = start_redis(port)
    yield port, process
    process.kill()


async def test_pooled_connections_survive_a_redis_restart(redis_port):
    port, process = redis_port
    client = redis_client.connect(f"redis://127.0.0.1:{port}/0")
    register = client.register_script("return redis.call('SET', KEYS[1], ARGV[1], 'NX')")  # as the kvbroker does
    assert await register(keys=["before"], args=["1"]) == b"OK"

    process.kill()
    process.wait()
    restarted = start_redis(port)
    try:
        assert await register(keys=["after"], args=["1"]) == b"OK"  # the pooled connection died with Redis
        assert await client.get("after") == b"1"
    finally:
        await client.aclose()
        restarted.kill()


async def test_a_redis_that_stops_answering_fails_commands_in_bounded_time_and_recovers(redis_port):
    import os
    import signal

    port, process = redis_port
    client = redis_client.connect(f"redis://127.0.0.1:{port}/0", socket_timeout=0.5, socket_connect_timeout=0.5)
    assert await client.set("k", "1")
    os.kill(process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            await client.get("k")
        assert time.monotonic() - started < (redis_client.RETRIES + 1) * 0.5 + 2  # the retries' backoff on top
    finally:
        os.kill(process.pid, signal.SIGCONT)
    assert await client.get("k") == b"1"
    await client.aclose()


def test_clients_time_out_by_default():
    client = redis_client.connect("redis://127.0.0.1:1/0")
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == redis_client.SOCKET_TIMEOUT_S
