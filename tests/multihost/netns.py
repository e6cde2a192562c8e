"""Hosts on one machine: Linux network namespaces joined by a bridge, each with its own address.

Each host is a namespace with a veth pair: one end inside (its address, e.g. 10.231.7.2/24), the other
on a bridge in the root namespace, which also holds an address (.254) so the test process can reach
every host. What runs in a host sees only its own interface and loopback, so services must bind and
advertise the host's address, and KV moves over TCP between hosts as it would between machines.

Faults: `cut(host)` takes the host's link down (packets are dropped silently, as on a pulled cable);
`block(host, peer)` drops only the traffic from peer to host (nftables in host's namespace).
Needs root (CAP_NET_ADMIN) and iproute2; nft for `block`. Names carry the test process's pid, so
concurrent runs do not collide, and `close()` removes everything it made.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess


@dataclasses.dataclass(frozen=True)
class Host:
    name: str  # "a", "b", ...
    namespace: str
    address: str  # its IPv4 address on the bridge
    veth: str  # its link's end on the bridge (root namespace): cut and restore act on it


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


class Testbed:
    """A bridge and the hosts on it. Use as a context manager, or call close()."""

    def __init__(self) -> None:
        pid = os.getpid()
        self._tag = f"{pid % 100000}"
        self.subnet = f"10.231.{pid % 250}"
        self.bridge = f"dsbr{self._tag}"
        self.gateway_address = f"{self.subnet}.254"  # the root namespace's, on the bridge
        self.hosts: dict[str, Host] = {}
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge, addressed .1, .2, ... in order of creation."""
        host = Host(name, f"ds{self._tag}{name}", f"{self.subnet}.{len(self.hosts) + 1}", f"dsv{self._tag}{name}")
        inner = f"dsi{self._tag}{name}"
        _ip("netns", "add", host.namespace)
        self.hosts[name] = host  # from here on, close() removes it
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", host.namespace)
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        self._in(host, "addr", "add", f"{host.address}/24", "dev", inner)
        self._in(host, "link", "set", inner, "up")
        self._in(host, "link", "set", "lo", "up")
        return host

    def command(self, host: Host, argv: list[str]) -> list[str]:
        """argv, run inside host."""
        return ["ip", "netns", "exec", host.namespace, *argv]

    def cut(self, host: Host) -> None:
        """The host's link goes down: nothing reaches it or leaves it, and no one is told."""
        _ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")

    def block(self, host: Host, peer: Host) -> None:
        """Drops every packet from peer arriving at host (both directions of any connection stall)."""
        rules = (f"add table inet dsblock\n"
                 f"add chain inet dsblock input {{ type filter hook input priority 0; }}\n"
                 f"add rule inet dsblock input ip saddr {peer.address} drop\n")
        subprocess.run(self.command(host, ["nft", "-f", "-"]), input=rules, text=True, check=True)

    def unblock(self, host: Host) -> None:
        subprocess.run(self.command(host, ["nft", "delete", "table", "inet", "dsblock"]), check=True)

    def close(self) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)  # takes its veth along
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.hosts.clear()

    def _in(self, host: Host, *args: str) -> None:
        _ip("-n", host.namespace, *args)

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
