"""The UCX transfer layer over real UCX: a cancelled pull never corrupts the next one on that peer."""

from __future__ import annotations

import asyncio

import pytest
import torch

from distserve.transfer.ucx_transfer import KvReceiver, KvSender, init_ucx

SHAPE = (2, 2, 2, 300, 64)  # [L, 2, H, T, D], ~600 KB


@pytest.mark.parametrize("cancel_after_yields", [1, 2, 3, 5, 8, 13])
async def test_pull_after_a_cancelled_pull_gets_its_own_bytes(cancel_after_yields):
    init_ucx()
    held = {"A": torch.full(SHAPE, 1.0), "B": torch.full(SHAPE, 2.0)}
    sender = KvSender(lookup=held.get, on_sent=lambda handle_id, num_bytes, seconds: held.pop(handle_id, None))
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    try:
        await receiver.connect(address)
        pull_a = asyncio.ensure_future(receiver.fetch(address, "A", torch.zeros(SHAPE), 10, "request-a"))
        for _ in range(cancel_after_yields):
            await asyncio.sleep(0)
        pull_a.cancel()
        await asyncio.gather(pull_a, return_exceptions=True)
        out_b = torch.zeros(SHAPE)
        await receiver.fetch(address, "B", out_b, 10, "request-b")
        assert out_b.unique().tolist() == [2.0], "B's buffer must hold B's bytes"
        for _ in range(100):  # the sender frees on the receiver's ack, a moment after the pull returns
            if "B" not in held:
                break
            await asyncio.sleep(0.01)
        assert "B" not in held, "the sender frees a buffer once its receipt is acknowledged"
    finally:
        await receiver.close()
        sender.stop()


async def test_unknown_handle_is_a_transfer_error_and_the_endpoint_recovers():
    from distserve.transfer.connector import TransferError

    init_ucx()
    held = {"B": torch.full(SHAPE, 3.0)}
    sender = KvSender(lookup=held.get, on_sent=lambda handle_id, num_bytes, seconds: held.pop(handle_id, None))
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    try:
        with pytest.raises(TransferError):
            await receiver.fetch(address, "missing", torch.zeros(SHAPE), 10)
        out = torch.zeros(SHAPE)
        await receiver.fetch(address, "B", out, 10)
        assert out.unique().tolist() == [3.0]
        assert receiver.counters.num_transfers == 1 and receiver.counters.num_bytes == out.numel() * 4
    finally:
        await receiver.close()
        sender.stop()
