"""redact_url hides passwords in Redis URLs, keeps everything else readable; free_port and bind failures."""

from __future__ import annotations

import socket

import pytest

from distserve.ports import free_port, is_bind_failure
from distserve.redact import redact_url


@pytest.mark.parametrize("url, shown", [
    ("redis://127.0.0.1:6390/0", "redis://127.0.0.1:6390/0"),
    ("redis://:s3cret@db:6379/0", "redis://:***@db:6379/0"),
    ("rediss://app:s3cret@db.example:6380/2?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required",
     "rediss://app:***@db.example:6380/2?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required"),
    ("redis://db:6379/0?password=s3cret", "redis://db:6379/0?password=***"),
    ("redis://app@db:6379/0", "redis://app@db:6379/0"),
    ("rediss://:p%40ss:word@db:6380", "rediss://:***@db:6380"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url) and "p%40ss" not in redact_url(url)


def test_unparsable_url_is_masked_not_echoed():
    assert redact_url("redis://:s3cret@[::1") == "***"


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_start = int(f.read().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(p < ephemeral_start for p in ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))


def test_bind_failures_are_recognised_in_child_logs():
    assert is_bind_failure("# Could not create server TCP listening socket 127.0.0.1:6390: bind: Address already in use")
    assert is_bind_failure("RuntimeError: Failed to bind to address 127.0.0.1:50051")
    assert is_bind_failure("OSError: [Errno 98] error while attempting to bind on address: address already in use")
    assert not is_bind_failure("Traceback ... ValueError: bad model path")
