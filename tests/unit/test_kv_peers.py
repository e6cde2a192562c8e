"""KvPeerPolicy: which UCX connections a KV sender serves, by the addresses they join (over a fake registry
listing); the sockaddr parsing that reads those addresses from UCX."""

from __future__ import annotations

import socket
import struct

import pytest

from distserve.transfer.kv_peers import KvPeerPolicy, host_of
from distserve.transfer.ucx_addresses import EndpointAddresses, sockaddr_ip


class FakeListing:
    """The registry's peer hosts, changeable; counts reads; fails while `failing`."""

    def __init__(self, *hosts: str) -> None:
        self.hosts, self.reads, self.failing = set(hosts), 0, False

    async def __call__(self) -> set[str]:
        self.reads += 1
        if self.failing:
            raise ConnectionError("redis is down")
        return set(self.hosts)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def policy(listing: FakeListing, local_ips: set[str] | None = None, clock: Clock | None = None) -> KvPeerPolicy:
    return KvPeerPolicy({"10.0.0.1"} if local_ips is None else local_ips, listing, refresh_interval_s=1.0,
                        clock=clock or Clock())


async def test_a_registered_peer_on_the_advertised_address_is_admitted():
    assert await policy(FakeListing("10.0.0.2")).admits(EndpointAddresses("10.0.0.1", "10.0.0.2")) is None


async def test_a_connection_arriving_on_another_local_address_is_refused_naming_it():
    checked = policy(FakeListing("10.0.0.2"))
    reason = await checked.admits(EndpointAddresses("192.168.1.5", "10.0.0.2"))
    assert reason is not None and "192.168.1.5" in reason and checked.num_refused == 1


async def test_a_peer_no_registered_worker_advertises_is_refused_naming_it():
    checked = policy(FakeListing("10.0.0.2"))
    reason = await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.66"))
    assert reason is not None and "10.0.0.66" in reason and checked.num_refused == 1


async def test_unknown_addresses_are_refused():
    assert await policy(FakeListing("10.0.0.2")).admits(None) is not None


async def test_a_wildcard_advertised_host_admits_any_local_address():
    checked = await KvPeerPolicy.for_worker("0.0.0.0", FakeListing("10.0.0.2"))
    assert await checked.admits(EndpointAddresses("172.17.0.3", "10.0.0.2")) is None


async def test_the_advertised_host_is_resolved_and_an_unresolvable_one_is_an_error():
    checked = await KvPeerPolicy.for_worker("localhost", FakeListing("127.0.0.1"))
    assert await checked.admits(EndpointAddresses("127.0.0.1", "127.0.0.1")) is None
    with pytest.raises(ValueError, match="advertise_host"):
        await KvPeerPolicy.for_worker("no-such-host.invalid", FakeListing())


async def test_a_peer_registered_after_the_last_read_is_admitted_at_its_first_connection():
    listing, clock = FakeListing("10.0.0.2"), Clock()
    checked = policy(listing, clock=clock)
    assert await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.2")) is None
    clock.now += 5
    listing.hosts.add("10.0.0.3")
    assert await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.3")) is None


async def test_misses_read_the_registry_at_most_once_per_interval_and_hits_never():
    listing, clock = FakeListing("10.0.0.2"), Clock()
    checked = policy(listing, clock=clock)
    for _ in range(5):
        await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.66"))
        await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.2"))
    assert listing.reads == 1
    clock.now += 1.0
    await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.66"))
    assert listing.reads == 2


async def test_a_failed_read_keeps_the_last_list():
    listing, clock = FakeListing("10.0.0.2"), Clock()
    checked = policy(listing, clock=clock)
    assert await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.2")) is None
    listing.failing, listing.hosts = True, set()
    clock.now += 5
    assert await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.66")) is not None  # read failed
    assert await checked.admits(EndpointAddresses("10.0.0.1", "10.0.0.2")) is None  # the last list stands


async def test_peer_hostnames_are_resolved():
    checked = policy(FakeListing("localhost"), local_ips={"127.0.0.1"})
    assert await checked.admits(EndpointAddresses("127.0.0.1", "127.0.0.1")) is None


@pytest.mark.parametrize("address, host", [("10.0.0.2:50080", "10.0.0.2"), ("[::1]:50080", "::1"),
                                           ("decode-0:50080", "decode-0"), ("decode-0", "decode-0")])
def test_host_of(address, host):
    assert host_of(address) == host


def _sockaddr_in(ip: str, port: int) -> bytes:
    raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_pton(socket.AF_INET, ip)
    return raw.ljust(128, b"\0")


def _sockaddr_in6(ip: str, port: int) -> bytes:
    raw = struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0) + socket.inet_pton(socket.AF_INET6, ip)
    return raw.ljust(128, b"\0")


def test_sockaddrs_are_read_as_ips():
    assert sockaddr_ip(_sockaddr_in("10.1.2.3", 13370)) == "10.1.2.3"
    assert sockaddr_ip(_sockaddr_in6("fd00::7", 13370)) == "fd00::7"
    assert sockaddr_ip(_sockaddr_in6("::ffff:10.1.2.3", 13370)) == "10.1.2.3"  # IPv4-mapped: as IPv4
    assert sockaddr_ip(b"\0" * 128) is None  # AF_UNSPEC: not a socket address
