"""Times KV transfers over the real UCX connector: the path a prompt's KV takes from a prefill
worker to a decode worker.

Producer and consumer live in this one process and talk over loopback, so both ends (and UCX's
notifier thread) share the cores this process is pinned to; a deployed pair has a core set each.
On one core that makes the measured times somewhat pessimistic. The buffers have the real KV
layout [L, 2, T, Hkv, D] for T tokens, and each time is what the consumer's `fetch` reports, as
a decode worker records it. The caller must call `connector.shutdown("ucx")` before the process
ends (UCX's notifier thread is not a daemon).
"""

from __future__ import annotations

import asyncio
import logging
import statistics

import torch

from distserve.transfer import connector

log = logging.getLogger(__name__)

MIN_BYTES = 64 * 1024
MAX_BYTES = 64 * 1024 * 1024
SIZE_STEP = 4  # each size is this many times the last
QUICK_MAX_BYTES = 1024 * 1024
FETCH_TIMEOUT_S = 60.0


def transfer_token_counts(kv_bytes_per_token: int, quick: bool = False) -> list[int]:
    """Token counts whose KV spans MIN_BYTES .. MAX_BYTES (QUICK_MAX_BYTES when quick), SIZE_STEP apart."""
    top = QUICK_MAX_BYTES if quick else MAX_BYTES
    tokens = max(1, -(-MIN_BYTES // kv_bytes_per_token))
    counts = []
    while tokens * kv_bytes_per_token <= top:
        counts.append(tokens)
        tokens *= SIZE_STEP
    return counts


def measure_transfers(kv_shape: tuple[int, int, int], dtype: torch.dtype, token_counts: list[int],
                      repeats: int) -> list[tuple[int, float]]:
    """(num_bytes, median seconds) per token count, pulling [L, 2, T, Hkv, D] buffers over UCX.

    kv_shape: (num_layers, num_kv_heads, head_dim). Each size is pulled once untimed first.
    """
    return asyncio.run(_measure(kv_shape, dtype, token_counts, repeats))


async def _measure(kv_shape: tuple[int, int, int], dtype: torch.dtype, token_counts: list[int],
                   repeats: int) -> list[tuple[int, float]]:
    num_layers, num_kv_heads, head_dim = kv_shape
    held: dict[str, torch.Tensor] = {}
    # The buffers stay held across repeats: a worker frees on on_sent, here the profile owns them.
    producer = connector.make_producer("ucx", held.get, lambda handle_id, num_bytes, seconds: None)
    address = f"127.0.0.1:{producer.start(0)}"
    consumer = connector.make_consumer("ucx")
    samples = []
    try:
        await consumer.connect(address)  # endpoint set-up is a worker's start-up cost, not a transfer's
        for tokens in token_counts:
            handle = f"profile-{tokens}"
            held[handle] = torch.ones((num_layers, 2, tokens, num_kv_heads, head_dim), dtype=dtype)
            out = torch.empty_like(held[handle])
            times = [await consumer.fetch(address, handle, out, FETCH_TIMEOUT_S, handle)
                     for _ in range(repeats + 1)][1:]
            samples.append((out.numel() * out.element_size(), statistics.median(times)))
            log.debug("transfer %d bytes: %.3f ms", samples[-1][0], samples[-1][1] * 1e3)
            del held[handle]
    finally:
        await consumer.close()
        await asyncio.sleep(0.05)  # lets the producer's endpoint handler see the close before its listener goes
        producer.stop()
    return samples
