"""The UCX transfer layer over real UCX, both ends in this process: a cancelled pull never corrupts the
next one on that peer; a puller without the handle's secret is refused; damaged bytes are pulled again
once, then fail with a checksum error."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from distserve.transfer import bound_listener
from distserve.transfer.checksum import kv_crc32c
from distserve.transfer.connector import ChecksumMismatch, PullRefused
from distserve.transfer.kv_peers import KvPeerPolicy
from distserve.transfer.ucx_transfer import KvReceiver, KvSender, init_ucx
from services.prefill.held_kv import HeldKv
from tests.listening_sockets import listening_ips

SHAPE = (2, 2, 2, 300, 64)  # [L, 2, H, T, D], ~600 KB


def serving_and_freeing(held: dict[str, torch.Tensor]) -> tuple[KvSender, str]:
    """A started sender of `held`'s buffers that drops each once its receipt is acknowledged, and its address."""
    sender = KvSender(lookup=held.get, on_sent=lambda handle_id, num_bytes, seconds: held.pop(handle_id, None))
    return sender, f"127.0.0.1:{sender.start(0)}"


@pytest.mark.parametrize("cancel_after_yields", [1, 2, 3, 5, 8, 13])
async def test_pull_after_a_cancelled_pull_gets_its_own_bytes(cancel_after_yields):
    init_ucx()
    held = {"A": torch.full(SHAPE, 1.0), "B": torch.full(SHAPE, 2.0)}
    sender, address = serving_and_freeing(held)
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
    sender, address = serving_and_freeing(held)
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


async def eventually(condition, timeout_s: float = 2.0) -> bool:
    """Whether condition() holds within timeout_s: a sender acts on the ack a moment after a pull returns."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return bool(condition())


def held_kv_sender(held: HeldKv, policy: KvPeerPolicy | None = None) -> KvSender:
    """A sender serving `held` as a prefill worker does: the secret checked, the buffer freed once sent,
    connections admitted by `policy` (None: all)."""
    return KvSender(lookup=held.lookup, on_sent=lambda handle_id, num_bytes, seconds: held.free(handle_id),
                    authorize=held.admits, admit_peer=policy and policy.admits)


def holding(value: float, handle_id: str) -> tuple[HeldKv, torch.Tensor, int]:
    """A prefill worker's held KV: one buffer of SHAPE filled with `value` under `handle_id`, its secret
    "router-minted-secret"; (held, the buffer, its CRC32C)."""
    held = HeldKv(max_bytes=1 << 30)
    kv = torch.full(SHAPE, value)
    return held, kv, held.add(handle_id, kv, lease_s=30, secret="router-minted-secret")


async def test_a_puller_without_the_secret_is_refused_and_the_owner_still_gets_the_kv():
    init_ucx()
    held = HeldKv(max_bytes=1 << 30)
    kv = torch.full(SHAPE, 4.0)
    crc = held.add("S", kv, lease_s=30, secret="router-minted-secret")
    sender = held_kv_sender(held)
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    try:
        for wrong in ("", "router-minted-secreT", "router-minted-secret-and-more"):
            out = torch.zeros(SHAPE)
            with pytest.raises(PullRefused, match="refused"):
                await receiver.fetch(address, "S", out, 10, "stranger", secret=wrong)
            assert out.abs().sum() == 0, "a refused puller receives no bytes"
            assert held.lookup("S") is kv, "a refused pull must not free the owner's KV"
        out = torch.zeros(SHAPE)
        await receiver.fetch(address, "S", out, 10, "owner", secret="router-minted-secret", crc32c=crc)
        assert torch.equal(out, kv) and receiver.counters.num_transfers == 1
        assert await eventually(lambda: held.lookup("S") is None), "the sender frees the KV once received"
    finally:
        await receiver.close()
        sender.stop()


def corrupting_lookup(good: torch.Tensor, num_corrupt: int):
    """A producer lookup that serves a copy with one flipped byte on its first num_corrupt pulls (bytes
    damaged in flight), then the good buffer."""
    served = []

    def lookup(handle_id: str) -> torch.Tensor:
        served.append(handle_id)
        if len(served) > num_corrupt:
            return good
        bad = good.clone()
        bad.view(-1).view(torch.uint8)[12345] ^= 0x40
        return bad

    return lookup, served


async def test_bytes_damaged_on_the_first_pull_are_pulled_again_and_verified():
    init_ucx()
    good = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3))
    lookup, served = corrupting_lookup(good, num_corrupt=1)
    sent = []
    sender = KvSender(lookup=lookup, on_sent=lambda handle_id, num_bytes, seconds: sent.append(handle_id))
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    try:
        out = torch.zeros(SHAPE)
        await receiver.fetch(address, "C", out, 10, crc32c=kv_crc32c(good))
        assert torch.equal(out, good) and len(served) == 2
        assert await eventually(lambda: sent) and sent == ["C"], "the sender frees on the verified pull's ack"
        assert receiver.counters.num_transfers == 1
    finally:
        await receiver.close()
        sender.stop()


async def test_bytes_damaged_on_both_pulls_fail_with_a_checksum_error_and_the_sender_keeps_them():
    init_ucx()
    good = torch.randn(SHAPE, generator=torch.Generator().manual_seed(4))
    lookup, served = corrupting_lookup(good, num_corrupt=2)
    sent = []
    sender = KvSender(lookup=lookup, on_sent=lambda handle_id, num_bytes, seconds: sent.append(handle_id))
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    try:
        with pytest.raises(ChecksumMismatch, match="checksum"):
            await receiver.fetch(address, "C", torch.zeros(SHAPE), 10, crc32c=kv_crc32c(good))
        assert len(served) == 2, "exactly one re-pull"
        out = torch.zeros(SHAPE)
        assert sent == [], "a failed checksum is not acknowledged as received: the sender keeps the KV"
        await receiver.fetch(address, "C", out, 10, crc32c=kv_crc32c(good))  # the third serve is good
        assert torch.equal(out, good) and receiver.counters.num_transfers == 1
        assert await eventually(lambda: sent) and sent == ["C"]
    finally:
        await receiver.close()
        sender.stop()


async def test_the_progress_thread_sleeps_the_set_interval_and_transfers_still_complete():
    """ucxx's own thread mode wakes every 1 ms; ours waits PROGRESS_IDLE_WAKE_MS between wake-ups with
    nothing to do, and relies on UCX's signals for work: a pull after an idle spell longer than that
    interval still completes with the right bytes."""
    from ucxx._lib_async import application_context

    from distserve.transfer.ucx_transfer import PROGRESS_IDLE_WAKE_MS

    init_ucx()
    held = {"C": torch.full(SHAPE, 4.0)}
    sender, address = serving_and_freeing(held)
    receiver = KvReceiver()
    try:
        await receiver.connect(address)
        progress = application_context.ProgressTasks[asyncio.get_running_loop()]
        assert progress.distserve_wake_ms == PROGRESS_IDLE_WAKE_MS > 1
        await asyncio.sleep(3 * PROGRESS_IDLE_WAKE_MS / 1000)  # the progress thread asleep in epoll_wait
        out = torch.zeros(SHAPE)
        await asyncio.wait_for(receiver.fetch(address, "C", out, 10), 5)
        assert out.unique().tolist() == [4.0]
    finally:
        await receiver.close()
        sender.stop()


async def test_a_connection_flood_is_turned_away_and_pulls_go_on_once_its_endpoints_time_out():
    """Endpoints that connect and ask for nothing: beyond the cap they are aborted at once; those within
    it are closed after the first-header timeout, and a real pull then goes through."""
    init_ucx()
    held = HeldKv(max_bytes=1 << 30)
    kv = torch.full(SHAPE, 5.0)
    crc = held.add("F", kv, lease_s=30, secret="router-minted-secret")
    sender = KvSender(lookup=held.lookup, on_sent=lambda handle_id, num_bytes, seconds: held.free(handle_id),
                      authorize=held.admits, max_endpoints=2, first_header_timeout_s=1.0)
    address = f"127.0.0.1:{sender.start(0)}"
    flood = [KvReceiver() for _ in range(5)]
    receiver = KvReceiver()
    try:
        await asyncio.gather(*(idle.connect(address) for idle in flood), return_exceptions=True)
        assert await eventually(lambda: sender.num_turned_away >= 3), "3 endpoints over the cap of 2"
        assert sender._num_endpoints <= 2
        assert await eventually(lambda: sender._num_endpoints == 0, timeout_s=5.0), "idle ones closed"
        out = torch.zeros(SHAPE)
        await receiver.fetch(address, "F", out, 10, "owner", secret="router-minted-secret", crc32c=crc)
        assert torch.equal(out, kv)
    finally:
        for idle in flood:
            await idle.close()
        await receiver.close()
        sender.stop()


async def test_a_suffix_pull_moves_only_the_tokens_from_its_start_verified_by_chunk_checksums():
    """A decode worker holding a prompt's first tokens pulls the rest: the bytes of tokens [128, 300),
    checked chunk by chunk against checksums of the whole buffer; a start past the buffer is refused."""
    from distserve.transfer.checksum import ChunkChecksums
    from distserve.transfer.connector import TransferError

    init_ucx()
    kv = torch.randn(2, 2, 300, 2, 64, generator=torch.Generator().manual_seed(5))  # [L, 2, T, Hkv, D]
    chunks = ChunkChecksums.of(kv)
    held = {"P": kv}
    sent = []
    sender = KvSender(lookup=held.get, on_sent=lambda handle_id, num_bytes, seconds: sent.append(num_bytes))
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    try:
        out = torch.zeros(2, 2, 300 - 128, 2, 64)
        await receiver.fetch(address, "P", out, 10, crc32c=chunks, from_token=128)
        assert torch.equal(out, kv[:, :, 128:])
        assert await eventually(lambda: sent) and sent == [out.numel() * 4]
        wrong = ChunkChecksums(chunks.chunk_tokens, chunks.crcs[:2] + (chunks.crcs[2] ^ 1,) + chunks.crcs[3:])
        with pytest.raises(ChecksumMismatch):
            await receiver.fetch(address, "P", torch.zeros(2, 2, 300 - 128, 2, 64), 10, crc32c=wrong, from_token=128)
        with pytest.raises(TransferError, match="not held"):
            await receiver.fetch(address, "P", torch.zeros(2, 2, 1, 2, 64), 10, from_token=300)
    finally:
        await receiver.close()
        sender.stop()


def policy_listing(peer_hosts: set[str], local_ips: set[str] | None = None) -> KvPeerPolicy:
    async def list_peer_hosts() -> set[str]:
        return peer_hosts

    return KvPeerPolicy(local_ips, list_peer_hosts)


@pytest.mark.parametrize("policy, admitted", [
    (policy_listing({"127.0.0.1"}, {"127.0.0.1"}), True),  # a registered peer, on the advertised address
    (policy_listing({"10.9.8.7"}, {"127.0.0.1"}), False),  # a peer no registered worker advertises
    (policy_listing({"127.0.0.1"}, {"10.9.8.7"}), False),  # arrived on an address the worker does not advertise
])
async def test_the_peer_policy_reads_the_connections_real_addresses_and_refuses_before_serving(policy, admitted):
    """The sender asks UCX which addresses a new connection joins (127.0.0.1 to 127.0.0.1 here) and serves
    it only if the policy admits them; a refused puller gets nothing, even with the right secret."""
    from distserve.transfer.connector import TransferError

    init_ucx()
    held, kv, crc = holding(6.0, "G")
    sender = held_kv_sender(held, policy)
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    out = torch.zeros(SHAPE)
    try:
        if admitted:
            await receiver.fetch(address, "G", out, 10, "owner", secret="router-minted-secret", crc32c=crc)
            assert torch.equal(out, kv) and policy.num_refused == 0
        else:
            with pytest.raises(TransferError):
                await receiver.fetch(address, "G", out, 5, "owner", secret="router-minted-secret", crc32c=crc)
            assert policy.num_refused >= 1 and sender.num_turned_away >= 1
            assert not out.any() and held.lookup("G") is not None  # nothing sent, the KV still held
    finally:
        await receiver.close()
        sender.stop()


async def test_a_sender_given_a_host_listens_there_only_and_serves_pulls_through_it():
    """The listener binds the host it is given (ucxx's own binds every interface): 127.0.0.1 and not
    0.0.0.0 in /proc/net/tcp, and a pull through that address gets its bytes."""
    init_ucx()
    held, kv, crc = holding(7.0, "B")
    sender = held_kv_sender(held)
    port = sender.start(0, "127.0.0.1")
    receiver = KvReceiver()
    out = torch.zeros(SHAPE)
    try:
        assert listening_ips(port) == {"127.0.0.1"}
        await receiver.fetch(f"127.0.0.1:{port}", "B", out, 10, "owner", secret="router-minted-secret", crc32c=crc)
        assert torch.equal(out, kv)
        # The endpoint stays pooled, its sender waiting for the next header: that wait must sleep. (An
        # endpoint made without Python futures polls with asyncio.sleep(0): 60% of a core, idle.)
        cpu_before = time.process_time()
        await asyncio.sleep(1.0)
        assert time.process_time() - cpu_before < 0.3
    finally:
        await receiver.close()
        sender.stop()


async def test_without_the_bound_listener_the_sender_says_so_and_listens_on_every_interface(monkeypatch, caplog):
    """Where the extension cannot be built (no compiler), the sender still serves, and says it binds
    every interface rather than the host it was given."""
    monkeypatch.setattr(bound_listener, "create_listener", lambda host, port, on_endpoint: None)
    init_ucx()
    sender = held_kv_sender(HeldKv(max_bytes=1 << 20))
    try:
        port = sender.start(0, "127.0.0.1")
        assert listening_ips(port) == {"0.0.0.0"}
        assert "listens on every interface, not only 127.0.0.1" in caplog.text
    finally:
        sender.stop()


async def test_a_pre_connect_refused_before_the_puller_registered_is_opened_again():
    """A decode worker may pre-connect a moment before the prefill worker sees its record: that endpoint is
    refused, no longer counts as open (so the next pre-connect opens another), and the first pull succeeds."""
    init_ucx()
    registered: set[str] = set()

    async def list_peer_hosts() -> set[str]:
        return set(registered)

    policy = KvPeerPolicy({"127.0.0.1"}, list_peer_hosts, refresh_interval_s=0.0)
    held, kv, crc = holding(7.0, "H")
    sender = held_kv_sender(held, policy)
    address = f"127.0.0.1:{sender.start(0)}"
    receiver = KvReceiver()
    try:
        await receiver.connect(address)
        assert await eventually(lambda: policy.num_refused == 1 and address not in receiver.peers)
        registered.add("127.0.0.1")
        await receiver.connect(address)
        assert address in receiver.peers
        out = torch.zeros(SHAPE)
        await receiver.fetch(address, "H", out, 10, "owner", secret="router-minted-secret", crc32c=crc)
        assert torch.equal(out, kv) and policy.num_refused == 1
    finally:
        await receiver.close()
        sender.stop()


async def test_turned_away_connections_are_counted_each_but_logged_once_per_reason(caplog):
    """A flood of refused connections is counted in full; the log gets one line per reason per 5 s."""
    init_ucx()
    policy = policy_listing({"10.9.8.7"}, {"127.0.0.1"})  # this process is no registered peer
    sender = KvSender(lookup=lambda handle_id: None, on_sent=lambda handle_id, num_bytes, seconds: None,
                      admit_peer=policy.admits)
    address = f"127.0.0.1:{sender.start(0)}"
    strangers = [KvReceiver() for _ in range(4)]
    try:
        with caplog.at_level("WARNING", logger="distserve.transfer.ucx_transfer"):
            await asyncio.gather(*(s.connect(address) for s in strangers))
            assert await eventually(lambda: sender.num_turned_away == 4)
        lines = [r.getMessage() for r in caplog.records if "turned away" in r.getMessage()]
        assert len(lines) == 1 and "127.0.0.1 is not the address of a registered" in lines[0]
    finally:
        for stranger in strangers:
            await stranger.close()
        sender.stop()
