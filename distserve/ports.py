"""Choosing loopback ports for children, and telling when a child failed because its port was taken.

A port chosen by binding port 0 and closing the socket is free only until
someone else binds it: the child binds it a moment later, and in between any
outgoing connection on the machine may be given it as its ephemeral port. So
`free_port` picks below the kernel's ephemeral range (outgoing connections never
get those), never hands out the same port twice in one process, and the
launcher still retries a child on fresh ports when its log shows a bind failure.

A port the user chose (or one of `distserve up`'s defaults, such as 50051) may lie inside that range,
and a connection's local end may hold it for a moment when a child comes to bind it. `held_by_a_server`
tells that from a real conflict (another server listening there), so the launcher can start the child
again on the same port instead of giving up.
"""

from __future__ import annotations

import random
import socket
import threading

_BIND_FAILURES = ("address already in use", "failed to bind", "could not create server tcp listening socket")
_LOWEST = 20000
_handed_out: set[int] = set()
_lock = threading.Lock()


def _ephemeral_start(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback TCP port nobody listens on now, outside the ephemeral range, not handed out before here."""
    top = _ephemeral_start()
    with _lock:
        for _ in range(200):
            port = random.randrange(_LOWEST, top) if top - _LOWEST > 1000 else 0
            if port in _handed_out:
                continue
            if port == 0:  # no room below the ephemeral range: let the kernel choose
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
            elif not _bindable(port):
                continue
            _handed_out.add(port)
            return port
    raise OSError("no free port found")


def held_by_a_server(port: int) -> bool:
    """Whether something listens on loopback `port` (it accepts a connection); False where the port is
    free or held only by a connection's local end."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def is_bind_failure(log_text: str) -> bool:
    """Whether a child's log says it could not listen because its address was taken."""
    lowered = log_text.lower()
    return any(marker in lowered for marker in _BIND_FAILURES)
