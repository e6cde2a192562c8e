"""The two IP addresses of a UCX endpoint's TCP connection, read from UCX itself (`ucp_ep_query`).

ucxx 0.52 exposes neither, and its listener takes only a port, so it accepts connections on every
interface. A KV sender reads them to refuse what binding would have kept out: connections that arrive
on an address other than the one the worker advertises, and peers that are not registered workers
(distserve.transfer.kv_peers).

`ucp_ep_query` fills a `ucp_ep_attr_t` (ucp/api/ucp.h, UCX >= 1.14):
    uint64_t field_mask; char name[32]; struct sockaddr_storage local_sockaddr, remote_sockaddr; ...
Only the fields named in field_mask are written. sockaddr_storage is 128 bytes, 8-aligned, so the local
address starts at byte 40 and the remote one at byte 168.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import socket
import struct

_FIELD_LOCAL_SOCKADDR, _FIELD_REMOTE_SOCKADDR = 1 << 1, 1 << 2
_SOCKADDR_BYTES = 128
_LOCAL_OFFSET = 8 + 32
_REMOTE_OFFSET = _LOCAL_OFFSET + _SOCKADDR_BYTES
_ATTR_BYTES = 1024  # the struct is 312 bytes in UCX 1.21; room for whatever a later one adds after it


@dataclasses.dataclass(frozen=True)
class EndpointAddresses:
    local: str  # the address the connection arrived on
    remote: str  # the peer's address


@functools.cache
def _ucp_ep_query():
    import libucx

    libucx.load_library()
    library = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
    query = library.ucp_ep_query
    query.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    query.restype = ctypes.c_int
    return query


def sockaddr_ip(raw: bytes) -> str | None:
    """The IP of a `struct sockaddr_storage` in `raw` (IPv4-mapped IPv6 as IPv4), or None if it is neither."""
    family = struct.unpack_from("=H", raw)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8])
    if family == socket.AF_INET6:
        ip = socket.inet_ntop(socket.AF_INET6, raw[8:24])
        return ip.removeprefix("::ffff:") if ip.startswith("::ffff:") and "." in ip else ip
    return None


def endpoint_addresses(ucp_endpoint: int) -> EndpointAddresses | None:
    """Both ends' IPs of the connection behind a `ucp_ep_h` (ucxx's `Endpoint.ucp_endpoint`); None when
    UCX cannot say (the endpoint is not a socket connection, or it already failed)."""
    attr = ctypes.create_string_buffer(_ATTR_BYTES)
    struct.pack_into("=Q", attr, 0, _FIELD_LOCAL_SOCKADDR | _FIELD_REMOTE_SOCKADDR)
    if _ucp_ep_query()(ucp_endpoint, attr) != 0:  # UCS_OK
        return None
    raw = attr.raw
    local = sockaddr_ip(raw[_LOCAL_OFFSET:_LOCAL_OFFSET + _SOCKADDR_BYTES])
    remote = sockaddr_ip(raw[_REMOTE_OFFSET:_REMOTE_OFFSET + _SOCKADDR_BYTES])
    if local is None or remote is None:
        return None
    return EndpointAddresses(local, remote)
