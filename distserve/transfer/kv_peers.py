"""Who may pull KV from a worker's UCX listener, by address.

The listener binds the advertised host (distserve.transfer.bound_listener), or every interface where
that cannot be built. A KvPeerPolicy refuses, before reading a byte, a connection that
- arrived on an address other than the worker's advertised host's (what binding refuses; checked again
  after accept for the fallback; skipped when the advertised host is a wildcard: every interface), or
- comes from an address that no registered decode or colocated worker advertises.

The kv_secret still authorizes each pull; this keeps strangers from reaching that check at all. Peers
are learned from the registry: on an unknown address the policy reads it again (at most once per
`refresh_interval_s`, concurrent misses sharing the read), so a worker that registered a moment ago
is admitted at its first pull. When a read fails, the last good list stands.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from typing import Awaitable, Callable

from distserve.transfer.ucx_addresses import EndpointAddresses

log = logging.getLogger(__name__)

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
PEER_ROLES = ("decode", "colocated")  # the roles that pull KV from a prefill worker


def host_of(address: str) -> str:
    """The host of "host:port" or "[v6]:port"."""
    host = address.rpartition(":")[0] if ":" in address else address
    return host.strip("[]")


async def resolve(host: str) -> set[str]:
    """Every IP `host` names (itself when it is an IP); empty when it does not resolve. A name is looked
    up off the event loop (as loop.getaddrinfo does)."""
    if (literal := _ip_literal(host.strip("[]"))) is not None:
        return literal
    return await asyncio.get_running_loop().run_in_executor(None, resolve_blocking, host)


def resolve_blocking(host: str) -> set[str]:
    """resolve(), for callers outside an event loop (start-up)."""
    host = host.strip("[]")
    if (literal := _ip_literal(host)) is not None:
        return literal
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {str(ipaddress.ip_address(info[4][0])) for info in infos}


def _ip_literal(host: str) -> set[str] | None:
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        return None


class KvPeerPolicy:
    """admits(addresses) -> None, or why the connection is refused."""

    def __init__(self, local_ips: set[str] | None, list_peer_hosts: Callable[[], Awaitable[set[str]]],
                 refresh_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        """local_ips: the advertised host's IPs (None: any local address). list_peer_hosts(): the hosts the
        registered peers advertise (raises on a failed read)."""
        self._local_ips = local_ips
        self._list_peer_hosts = list_peer_hosts
        self._refresh_interval_s = refresh_interval_s
        self._clock = clock
        self._peer_ips: set[str] = set()
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Task | None = None
        self.num_refused = 0

    @classmethod
    async def for_worker(cls, advertise_host: str, list_peer_hosts: Callable[[], Awaitable[set[str]]],
                         **kwargs) -> "KvPeerPolicy":
        """The policy of a worker advertising `advertise_host` (a wildcard: any local address)."""
        local_ips = None if advertise_host in WILDCARD_HOSTS else await resolve(advertise_host)
        if local_ips is not None and not local_ips:
            raise ValueError(f"advertise_host: {advertise_host!r} does not resolve to an address")
        return cls(local_ips, list_peer_hosts, **kwargs)

    async def admits(self, addresses: EndpointAddresses | None) -> str | None:
        """None if the connection may go on, else the reason it is refused (counted in num_refused)."""
        reason = await self._refusal(addresses)
        if reason is not None:
            self.num_refused += 1
        return reason

    async def _refusal(self, addresses: EndpointAddresses | None) -> str | None:
        if addresses is None:
            return "UCX cannot tell the connection's addresses"
        if self._local_ips is not None and addresses.local not in self._local_ips:
            return f"arrived on {addresses.local}, not on the advertised address"
        if addresses.remote in self._peer_ips:
            return None
        if self._clock() - self._refreshed_at >= self._refresh_interval_s:
            await self._refresh()
        if addresses.remote in self._peer_ips:
            return None
        return f"{addresses.remote} is not the address of a registered decode or colocated worker"

    async def _refresh(self) -> None:
        if self._refreshing is None:
            self._refreshing = asyncio.ensure_future(self._read_peers())
        refreshing = self._refreshing
        try:
            await asyncio.shield(refreshing)
        finally:
            if self._refreshing is refreshing and refreshing.done():
                self._refreshing = None

    async def _read_peers(self) -> None:
        try:
            hosts = await self._list_peer_hosts()
            resolved = await asyncio.gather(*(resolve(host) for host in hosts))
        except Exception as exc:  # Redis down: the last good list stands
            log.warning("kv peers: could not read the registry (%r); keeping the last list", exc)
            return
        finally:
            self._refreshed_at = self._clock()
        self._peer_ips = set().union(*resolved)
