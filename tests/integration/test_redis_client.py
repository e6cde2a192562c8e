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
