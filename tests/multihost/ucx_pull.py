"""A stranger's KV pull, run inside a host of the testbed: `python -m tests.multihost.ucx_pull HOST:PORT`
asks the UCX listener there for a handle with a well-formed secret and prints how it ended: "refused"
(the pull failed before the sender answered anything; why follows) or "answered: ..." (the sender read the
request and answered it)."""

from __future__ import annotations

import asyncio
import sys

import torch

from distserve.transfer.connector import TransferError
from distserve.transfer.ucx_transfer import KvReceiver, init_ucx, stop_ucx


async def pull(address: str) -> str:
    init_ucx()  # on this event loop: ucxx binds its progress to the loop that starts it
    receiver = KvReceiver()
    try:
        await receiver.fetch(address, "no-such-handle", torch.zeros(4), 5, "stranger", secret="s" * 32)
        return "answered: a buffer"
    except TransferError as exc:
        return f"answered: {exc}" if "not held" in str(exc) else f"refused: {exc}"
    finally:
        await receiver.close()


if __name__ == "__main__":
    print(asyncio.run(pull(sys.argv[1])), flush=True)
    stop_ucx()
