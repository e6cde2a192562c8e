"""Which TCP sockets listen where, read from /proc (no `ss` needed): the tests that check that no process
listens on a wildcard address, and that a listener binds the host it was given."""

from __future__ import annotations

import ipaddress
from pathlib import Path

LISTEN = "0A"  # the TCP state column of /proc/net/tcp{,6}


def _ip(hex_address: str) -> str:
    """/proc/net/tcp's address column (host byte order, per 32-bit word) as an IP string."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket's IPv4 address
    return str(mapped or address)


def listening() -> dict[str, tuple[str, int]]:
    """inode -> (IP, port) of every TCP socket in LISTEN on this machine's network namespace."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port = fields[1].split(":")
            if fields[3] == LISTEN:
                found[fields[9]] = (_ip(address), int(port, 16))
    return found


def listening_ips(port: int) -> set[str]:
    """The IPs something listens on at TCP `port`."""
    return {ip for ip, bound_port in listening().values() if bound_port == port}


def socket_inodes(pid: int) -> set[str]:
    """The socket inodes a process holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def wildcard_ports(pid: int) -> set[int]:
    """The ports a process listens on at 0.0.0.0 or ::."""
    sockets = listening()
    return {sockets[inode][1] for inode in socket_inodes(pid)
            if inode in sockets and sockets[inode][0] in ("0.0.0.0", "::")}


def listening_ips_of(pid: int) -> set[str]:
    """The IPs a process listens on."""
    sockets = listening()
    return {sockets[inode][0] for inode in socket_inodes(pid) if inode in sockets}
