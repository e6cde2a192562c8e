"""Which network interfaces UCX may use: only the one that holds the worker's advertised address.

Besides the KV listener (distserve.transfer.bound_listener), UCX's TCP transport listens on every IP
interface it is allowed, each on that interface's address: a worker advertising 127.0.0.1 still listened
on eth0's. UCX has no per-transport address setting, only UCX_NET_DEVICES, which names devices of every
transport (RDMA ones too), so rather than list the allowed ones, this lists the IP interfaces to leave
out ("^eth0,docker0": all devices but those): RDMA devices, which have other names, stay usable.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

from distserve.transfer.kv_peers import WILDCARD_HOSTS, resolve_blocking

log = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_addresses() -> dict[str, set[str]]:
    """Every IP interface's name -> its addresses (IPv4 through ioctl, IPv6 from /proc/net/if_inet6)."""
    found: dict[str, set[str]] = {name: set() for _, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in found:
            try:
                request = struct.pack("256s", name.encode()[:15])
                found[name].add(socket.inet_ntoa(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24]))
            except OSError:  # no IPv4 address
                pass
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if fields[-1] in found:
                    found[fields[-1]].add(str(ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    except OSError:
        pass
    return found


def excluded_devices(advertise_host: str, interfaces: dict[str, set[str]]) -> str | None:
    """UCX_NET_DEVICES leaving out every interface of `interfaces` but those holding advertise_host's
    address; None when nothing is to be left out (a wildcard host, an address no interface holds, as
    behind NAT, or no other interface)."""
    if advertise_host in WILDCARD_HOSTS:
        return None
    addresses = resolve_blocking(advertise_host)
    holding = {name for name, held in interfaces.items() if held & addresses}
    others = sorted(set(interfaces) - holding)
    if not holding or not others:
        return None
    return "^" + ",".join(others)


def restrict_to_advertised(advertise_host: str) -> None:
    """Sets UCX_NET_DEVICES (before UCX starts) so UCX uses only advertise_host's interface, unless the
    operator set it."""
    if "UCX_NET_DEVICES" in os.environ:
        return
    devices = excluded_devices(advertise_host, interface_addresses())
    if devices is not None:
        os.environ["UCX_NET_DEVICES"] = devices
        log.debug("UCX_NET_DEVICES=%s (only the interface of %s)", devices, advertise_host)
