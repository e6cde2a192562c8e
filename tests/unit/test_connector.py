"""The KV connector seam: the in-process connector's contract, and the registry of connectors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from distserve.transfer.checksum import ChunkChecksums, kv_crc32c
from distserve.transfer.connector import (ChecksumMismatch, LocalConsumer, PullRefused, TransferError, make_consumer,
                                          make_producer)


def test_local_fetch_copies_the_buffer_and_reports_it_sent():
    held = {"h1": torch.arange(24, dtype=torch.float32).view(2, 2, 3, 1, 2)}
    sent = []
    producer = make_producer("local", held.get, lambda h, n, s: sent.append((h, n)))
    port = producer.start()
    consumer = make_consumer("local")
    try:
        out = torch.zeros(2, 2, 3, 1, 2)
        seconds = asyncio.run(consumer.fetch(f"local:{port}", "h1", out, 1.0, "r"))
        assert torch.equal(out, held["h1"]) and seconds >= 0
        assert sent == [("h1", 96)]
        assert (producer.counters.num_bytes, consumer.counters.num_transfers) == (96, 1)
        assert f"local:{port}" in consumer.peers
    finally:
        producer.stop()


async def test_local_fetch_of_an_unknown_handle_or_shape_is_a_transfer_error():
    held = {"h1": torch.zeros(1, 2, 4, 1, 1)}
    producer = make_producer("local", held.get, lambda *args: None)
    port = producer.start()
    try:
        with pytest.raises(TransferError, match="not held"):
            await LocalConsumer().fetch(f"local:{port}", "missing", torch.zeros(1, 2, 4, 1, 1), 1.0)
        with pytest.raises(TransferError, match="expected"):
            await LocalConsumer().fetch(f"local:{port}", "h1", torch.zeros(1, 2, 5, 1, 1), 1.0)
    finally:
        producer.stop()
    with pytest.raises(TransferError, match="no local producer"):
        await LocalConsumer().fetch(f"local:{port}", "h1", torch.zeros(1, 2, 4, 1, 1), 1.0)


async def test_local_fetch_presents_the_secret_and_verifies_the_checksum():
    kv = torch.arange(8, dtype=torch.float32).view(1, 2, 4, 1, 1)
    held = {"h1": kv}
    producer = make_producer("local", held.get, lambda *args: None,
                             authorize=lambda handle_id, secret: secret == "s3cret")
    address = f"local:{producer.start()}"
    try:
        with pytest.raises(PullRefused, match="refused"):
            await LocalConsumer().fetch(address, "h1", torch.zeros_like(kv), 1.0, secret="")
        with pytest.raises(ChecksumMismatch, match="checksum"):
            await LocalConsumer().fetch(address, "h1", torch.zeros_like(kv), 1.0, secret="s3cret",
                                        crc32c=kv_crc32c(kv) ^ 1)
        out = torch.zeros_like(kv)
        await LocalConsumer().fetch(address, "h1", out, 1.0, secret="s3cret", crc32c=kv_crc32c(kv))
        assert torch.equal(out, kv)
    finally:
        producer.stop()


def test_the_checksum_covers_every_byte_of_any_dtype():
    kv = torch.randn(2, 2, 3, 2, 4).to(torch.bfloat16)
    damaged = kv.clone()
    damaged.view(-1).view(torch.uint8)[-1] ^= 1
    assert kv_crc32c(kv) == kv_crc32c(kv.clone()) != kv_crc32c(damaged)


def test_an_unknown_connector_is_named():
    with pytest.raises(ValueError, match="kv_connector: 'rdma'"):
        make_consumer("rdma")
    with pytest.raises(ValueError, match="kv_connector: 'rdma'"):
        make_producer("rdma", dict().get, lambda *args: None)


async def test_local_fetch_of_a_suffix_copies_and_verifies_only_those_tokens():
    kv = torch.arange(2 * 2 * 10 * 3, dtype=torch.float32).view(2, 2, 10, 3, 1)  # [L, 2, T, Hkv, D]
    chunks = ChunkChecksums.of(kv, chunk_tokens=4)
    producer = make_producer("local", {"h1": kv}.get, lambda *args: None)
    address = f"local:{producer.start()}"
    try:
        out = torch.zeros(2, 2, 6, 3, 1)
        await LocalConsumer().fetch(address, "h1", out, 1.0, crc32c=chunks, from_token=4)
        assert torch.equal(out, kv[:, :, 4:])
        with pytest.raises(ChecksumMismatch):
            await LocalConsumer().fetch(address, "h1", out, 1.0, crc32c=ChunkChecksums(4, (0, 0, 0)), from_token=4)
    finally:
        producer.stop()


def test_chunk_checksums_verify_any_chunk_aligned_suffix_and_nothing_else():
    kv = torch.randn(3, 2, 50, 2, 8).to(torch.bfloat16)
    chunks = ChunkChecksums.of(kv, chunk_tokens=16)
    assert len(chunks.crcs) == 4  # 16, 16, 16 and 2 tokens
    for start in (0, 16, 32, 48):
        assert chunks.matches(kv[:, :, start:].contiguous(), start)
    assert not chunks.matches(kv[:, :, 16:].contiguous(), 32)
    damaged = kv[:, :, 32:].clone()
    damaged[2, 1, 17, 1, 3] += 1  # the last chunk, last layer's values
    assert not chunks.matches(damaged, 32)
    with pytest.raises(ValueError):
        chunks.matches(kv[:, :, 8:].contiguous(), 8)
