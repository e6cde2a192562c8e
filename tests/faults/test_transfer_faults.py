"""Transfer faults with real processes and real UCX: a stalled peer costs one transfer timeout and
blocks nobody else; a stranger with a valid handle id but not its secret is refused.

Each peer is a separate process (tests/faults/ucx_peer.py) serving fixed buffers; this test process
pulls from them with the decode worker's KvReceiver. A peer is stalled with SIGSTOP (the whole process)
or by its "stall" handle (one pull accepted and never answered).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from distserve.transfer.connector import PullRefused, TransferError
from distserve.transfer.ucx_transfer import KvReceiver, init_ucx
from tests.faults.ucx_peer import SECRET, SHAPE, STALLED_HANDLE

TIMEOUT_S = 3.0
PROMPT_S = 1.5  # a healthy pull, new endpoint included, finishes well within this on a loaded 2-core box


class Peer:
    def __init__(self) -> None:
        self.popen = subprocess.Popen([sys.executable, "-m", "tests.faults.ucx_peer"], stdout=subprocess.PIPE,
                                      text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        line = self.popen.stdout.readline()
        assert line.startswith("PORT "), f"ucx peer did not start: {line!r}"
        self.address = f"127.0.0.1:{int(line.split()[1])}"

    def stop(self) -> None:
        self.popen.send_signal(signal.SIGCONT)
        self.popen.terminate()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@pytest.fixture(scope="module")
def peers():
    started = [Peer(), Peer()]
    yield started
    for peer in started:
        peer.stop()


@pytest.fixture
async def receiver():
    init_ucx()
    receiver = KvReceiver()
    yield receiver
    await receiver.close()


async def timed_pull(receiver: KvReceiver, address: str, handle_id: str, **kwargs) -> tuple[float, object]:
    """(seconds, the exception or the pulled tensor); the peer's secret unless `secret` says otherwise."""
    kwargs.setdefault("secret", SECRET)
    out = torch.zeros(SHAPE)
    started = time.monotonic()
    try:
        await receiver.fetch(address, handle_id, out, TIMEOUT_S, **kwargs)
    except Exception as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, out


def assert_timed_out(seconds: float, result) -> None:
    assert isinstance(result, TransferError) and "timed out" in str(result), repr(result)
    assert TIMEOUT_S - 0.1 <= seconds < TIMEOUT_S + 1.5, f"a stalled pull ended after {seconds:.2f} s"


def assert_pulled(seconds: float, result, value: float) -> None:
    assert isinstance(result, torch.Tensor), repr(result)
    assert result.unique().tolist() == [value]
    assert seconds < PROMPT_S, f"a healthy pull took {seconds:.2f} s"


async def test_a_stopped_peer_costs_one_timeout_and_blocks_no_other_peer(peers, receiver):
    stalled, healthy = peers
    for peer in peers:  # warm: endpoints open, as a decode worker's pre-connect leaves them
        assert_pulled(*await timed_pull(receiver, peer.address, "A"), 1.0)
    os.kill(stalled.popen.pid, signal.SIGSTOP)
    try:
        stalled_pulls = [asyncio.ensure_future(timed_pull(receiver, stalled.address, h)) for h in ("A", "B")]
        await asyncio.sleep(0.2)  # both are now waiting on the stopped peer
        for handle_id, value in (("A", 1.0), ("B", 2.0), ("A", 1.0)):
            assert_pulled(*await timed_pull(receiver, healthy.address, handle_id), value)
        for seconds, result in await asyncio.gather(*stalled_pulls):
            assert_timed_out(seconds, result)  # side by side: neither waited behind the other
    finally:
        os.kill(stalled.popen.pid, signal.SIGCONT)
    # The broken endpoints were dropped: the next pull opens a fresh one and succeeds.
    seconds, result = await timed_pull(receiver, stalled.address, "B")
    assert isinstance(result, torch.Tensor) and result.unique().tolist() == [2.0], repr(result)


async def test_connecting_to_a_stopped_peer_times_out(peers, receiver):
    stalled, healthy = peers
    os.kill(stalled.popen.pid, signal.SIGSTOP)
    try:
        stalled_pull = asyncio.ensure_future(timed_pull(receiver, stalled.address, "A"))
        await asyncio.sleep(0.2)
        seconds, result = await timed_pull(receiver, healthy.address, "A")
        assert isinstance(result, torch.Tensor) and seconds < TIMEOUT_S - 0.5, (seconds, result)
        assert_timed_out(*await stalled_pull)
    finally:
        os.kill(stalled.popen.pid, signal.SIGCONT)


async def test_a_stalled_pull_does_not_block_other_handles_on_the_same_peer(peers, receiver):
    peer = peers[1]
    assert_pulled(*await timed_pull(receiver, peer.address, "A"), 1.0)  # one endpoint open and idle
    stalled_pull = asyncio.ensure_future(timed_pull(receiver, peer.address, STALLED_HANDLE))
    await asyncio.sleep(0.2)  # it holds the open endpoint now
    for handle_id, value in (("A", 1.0), ("B", 2.0)):
        assert_pulled(*await timed_pull(receiver, peer.address, handle_id), value)
    assert_timed_out(*await stalled_pull)
    assert_pulled(*await timed_pull(receiver, peer.address, "A"), 1.0)


async def test_a_stranger_with_the_handle_id_but_not_its_secret_is_refused(peers, receiver):
    peer = peers[0]
    for wrong in ("", "peer-secret", SECRET + "x", SECRET.upper()):
        seconds, result = await timed_pull(receiver, peer.address, "S", secret=wrong)
        assert isinstance(result, PullRefused) and "refused" in str(result), repr(result)
    assert_pulled(*await timed_pull(receiver, peer.address, "S", secret=SECRET), 3.0)
    # A handle held without a secret admits no puller: none presenting a secret, none presenting "".
    for secret in (SECRET, ""):
        seconds, result = await timed_pull(receiver, peer.address, "OPEN", secret=secret)
        assert isinstance(result, PullRefused), repr(result)
