"""A stand-in prefill worker for transfer fault tests: serves fixed KV buffers over real UCX.

    python -m tests.faults.ucx_peer   prints "PORT <n>", then serves until SIGTERM

Handles: "A" (all 1.0) and "B" (all 2.0) for any puller, "S" (all 3.0) only to pullers presenting
SECRET, and "stall", whose pull is accepted and never answered (a peer stuck mid-transfer). Buffers are
never freed, so a test may pull them again.
"""

from __future__ import annotations

import asyncio
import signal

import torch

from distserve.transfer.ucx_transfer import KvSender, stop_ucx
from services.prefill.held_kv import HeldKv

SHAPE = (2, 2, 300, 2, 64)  # [L, 2, T, H, D], ~600 KB of float32
SECRET = "peer-secret-3f9a"
STALLED_HANDLE = "stall"


class StallingSender(KvSender):
    async def _serve_one(self, ep, fields: dict, sending: list) -> None:
        if fields["handle_id"] == STALLED_HANDLE:
            await asyncio.sleep(3600)
        await super()._serve_one(ep, fields, sending)


def held_buffers() -> HeldKv:
    held = HeldKv(max_bytes=1 << 30)
    held.add("A", torch.full(SHAPE, 1.0), lease_s=3600, secret=SECRET)
    held.add("B", torch.full(SHAPE, 2.0), lease_s=3600, secret=SECRET)
    held.add("S", torch.full(SHAPE, 3.0), lease_s=3600, secret=SECRET)
    held.add(STALLED_HANDLE, torch.full(SHAPE, 4.0), lease_s=3600, secret=SECRET)
    held.add("OPEN", torch.full(SHAPE, 5.0), lease_s=3600)  # held without a secret: admits no puller
    return held


async def serve() -> None:
    held = held_buffers()
    sender = StallingSender(held.lookup, lambda handle_id, num_bytes, seconds: None, held.admits)
    print(f"PORT {sender.start(0)}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    sender.stop()


if __name__ == "__main__":
    asyncio.run(serve())
    stop_ucx()
