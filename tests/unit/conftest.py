"""Unit-test fixtures: a real throwaway redis-server, the tiny model's spec and its tokenizer."""

from __future__ import annotations

import subprocess
import time

import pytest
import redis
import redis.asyncio as aioredis

from distserve.launcher import find_redis_server, free_port
from distserve.model_spec import load_model_spec


def _wait_for_ping(url: str, process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {process.returncode}")
            try:
                if client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server at {url} did not answer PING within {timeout_s}s")
    finally:
        client.close()


@pytest.fixture(scope="session")
def spec(tiny_model_path):
    """The tiny model's ModelSpec."""
    return load_model_spec(tiny_model_path)


@pytest.fixture(scope="session")
def redis_url():
    """A redis-server of our own on a free loopback port, without persistence."""
    port = free_port()
    process = subprocess.Popen(
        [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        _wait_for_ping(url, process)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
async def redis_client(redis_url):
    """An asyncio client on an empty database."""
    client = aioredis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
