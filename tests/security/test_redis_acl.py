"""The Redis `distserve up` starts admits no one without a password, and each service only as its role
(distserve.redis_acl): a prefill worker's credentials cannot write what only routers or the kvbroker
write, nor flush or reconfigure Redis; the system serves with every role on its own user, and no password
reaches a command line or a log."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from distserve.redis_acl import ROLES
from distserve.registry import SPILLING_KEY, worker_key
from services.kvbroker.store import handle_key, release_channel
from tests.builders import generate, token_request

NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries an AuthenticationError (a ConnectionError) by default
EXPECTED_USERS = {"kvbroker": "kvbroker", "router": "router", "prefill-0": "prefill", "decode-0": "decode"}


def _port(cluster) -> int:
    return urlsplit(cluster.redis_url).port


def test_the_system_serves_with_every_service_on_its_own_user(signed_cluster):
    answer = generate(signed_cluster.router_address, token_request([40, 41, 42], max_tokens=4))
    assert len(answer.token_ids) == 4
    for name, user in EXPECTED_USERS.items():
        url = urlsplit(signed_cluster.processes[name].env["DISTSERVE_REDIS_URL"])
        assert (url.username, url.hostname, url.port) == (user, "127.0.0.1", _port(signed_cluster))
    admin = redis.Redis.from_url(signed_cluster.redis_url)
    connected = {client["user"] for client in admin.client_list()}
    assert {"kvbroker", "router", "prefill", "decode"} <= connected <= set(ROLES)
    # No service was refused a command it needed: Redis logs every refusal (redis-py's CLIENT SETINFO
    # aside, which it sends to any Redis and may be refused harmlessly).
    # redis-py's CLIENT SETINFO on connect, which Redis 7 logs as client|setinfo and Redis 6 as client
    refused = [entry for entry in admin.acl_log() if entry["object"] not in ("client|setinfo", "client")]
    assert refused == []


def test_a_client_without_credentials_is_refused(signed_cluster):
    anonymous = redis.Redis(port=_port(signed_cluster), protocol=2, retry=NO_RETRY)  # RESP2: no HELLO
    for command in (lambda: anonymous.get(SPILLING_KEY), lambda: anonymous.set("distserve:planted", 1),
                    lambda: anonymous.keys("*"), anonymous.flushall):
        with pytest.raises(redis.AuthenticationError, match="Authentication required"):
            command()
    with socket.create_connection(("127.0.0.1", _port(signed_cluster)), timeout=5) as raw:
        raw.sendall(b"KEYS *\r\n")
        assert raw.recv(128).startswith(b"-NOAUTH")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=_port(signed_cluster), username="router", password="guessed", retry=NO_RETRY).ping()


def test_a_prefill_workers_credentials_write_only_prefill_records(signed_cluster):
    prefill = redis.Redis.from_url(signed_cluster.redis_url_for("prefill"), retry=NO_RETRY)
    refused = {
        "router's spilling mark": lambda: prefill.set(SPILLING_KEY, 1, px=1000),
        "kvbroker's handle": lambda: prefill.hset(handle_key("planted"), "state", "ready"),
        "kvbroker's release": lambda: prefill.publish(release_channel("prefill-0"), "h"),
        "decode record": lambda: prefill.set(worker_key("decode", "planted"), "{}", px=1000),
        "FLUSHALL": prefill.flushall,
        "CONFIG SET": lambda: prefill.config_set("save", "60 1"),
        "CONFIG GET": lambda: prefill.config_get("requirepass"),
        "KEYS": lambda: prefill.keys("*"),
        "ACL": prefill.acl_list,
        "SHUTDOWN": lambda: prefill.execute_command("SHUTDOWN", "NOSAVE"),
    }
    for what, command in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
            pytest.fail(f"prefill's user may: {what}")
    admin = redis.Redis.from_url(signed_cluster.redis_url)
    assert admin.exists(SPILLING_KEY, handle_key("planted"), worker_key("decode", "planted")) == 0
    admin.acl_log_reset()  # the refusals above were this test's


def test_no_password_reaches_a_command_line_or_a_log(signed_cluster):
    log_dir = Path(signed_cluster.log_dir)
    passwords = list(signed_cluster.redis_passwords.values())
    assert len(passwords) == len(ROLES)
    for process in signed_cluster.processes.values():
        cmdline = Path(f"/proc/{process.popen.pid}/cmdline").read_bytes().decode(errors="replace")
        assert not any(p in cmdline for p in passwords), process.name
        log_text = process.log_path.read_text(errors="replace")
        assert not any(p in log_text for p in passwords), process.name
    acl_file, url_file = log_dir / "redis.acl", log_dir / "redis.url"
    for private in (acl_file, url_file):
        assert private.stat().st_mode & 0o777 == 0o600
    assert not any(p in acl_file.read_text() for p in passwords)  # hashes only
    assert url_file.read_text().strip() == signed_cluster.redis_url
    assert os.stat(log_dir / "registry.key").st_mode & 0o777 == 0o600
