"""`fleet`: the system spread over four hosts (network namespaces on one machine, tests/multihost/netns.py).

host a: Redis, kvbroker, router (mutual TLS) and gateway (API key); host b: a prefill worker; hosts c and
d: a decode worker each. Every service binds and advertises its host's address, gRPC between services is
mutual TLS, and UCX is limited to TCP (UCX_TLS=tcp): without that it would find the other processes on
the same machine and move KV through shared memory, past the links the tests cut. Module scope.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

import pytest
import redis

from distserve.dev_certs import SERVER_NAME, make_dev_certs
from distserve.grpc_server import TlsConfig
from distserve.launcher import find_redis_server
from tests.cluster_helpers import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, wait_for_registry
from tests.multihost.netns import Host, Testbed

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-multihost-test-key"
TRANSFER_TIMEOUT_S = 4.0  # a decode worker gives up on a KV pull that stalls this long
PORTS = {"redis": 6379, "kvbroker": 50060, "router": 50051, "gateway": 8000, "prefill": 50070, "decode": 50080}


@dataclasses.dataclass
class Service:
    name: str
    host: Host
    popen: subprocess.Popen
    log_path: Path
    restart: Callable[[], subprocess.Popen]  # starts it again, as it was started, its log appended


@dataclasses.dataclass
class Fleet:
    testbed: Testbed
    tls: TlsConfig
    services: dict[str, Service]
    redis_url: str
    router_address: str
    gateway_url: str

    def host(self, name: str) -> Host:
        return self.testbed.hosts[name]

    def kill(self, service: str) -> None:
        self.services[service].popen.kill()
        self.services[service].popen.wait(timeout=30)

    def restart(self, service: str) -> None:
        """Starts an exited service again on its host, with the same command."""
        assert self.services[service].popen.poll() is not None, f"{service} is still running"
        self.services[service].popen = self.services[service].restart()

    def log(self, service: str) -> str:
        return self.services[service].log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def fleet(tiny_model_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("multihost-logs")
    tls = make_dev_certs(logs / "tls")
    with Testbed() as testbed:
        a, b, c, d = (testbed.add_host(name) for name in "abcd")
        env = _environment(tiny_model_path, tls, a)
        services: dict[str, Service] = {}
        try:
            start = _starter(testbed, env, logs, services)
            start("redis", a, [find_redis_server(), "--bind", a.address, "--port", str(PORTS["redis"]), "--save", "",
                               "--appendonly", "no", "--protected-mode", "no"])
            _wait_redis(env["DISTSERVE_REDIS_URL"])
            start("kvbroker", a, _python("services.kvbroker", a, PORTS["kvbroker"]))
            start("prefill", b, _python("services.prefill", b, PORTS["prefill"], "--advertise-host", b.address,
                                        *PREFILL_TEST_ARGS))
            for host in (c, d):
                start(f"decode-{host.name}", host, _python(
                    "services.decode", host, PORTS["decode"], "--advertise-host", host.address, *DECODE_TEST_ARGS,
                    "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)))
            start("router", a, _python("services.router", a, PORTS["router"]))
            start("gateway", a, ["-m", "services.router.gateway", "--host", a.address, "--port", str(PORTS["gateway"]),
                                 "--router-address", f"{a.address}:{PORTS['router']}"])
            fleet = Fleet(testbed, dataclasses.replace(tls, tls_server_name=SERVER_NAME), services,
                          env["DISTSERVE_REDIS_URL"], f"{a.address}:{PORTS['router']}",
                          f"http://{a.address}:{PORTS['gateway']}")
            wait_registered(fleet, {"prefill": 1, "decode": 2})
            _wait_gateway(fleet)
            yield fleet
        finally:
            for service in reversed(list(services.values())):
                service.popen.kill()
                service.popen.wait(timeout=30)


def wait_registered(fleet: Fleet, wanted: dict[str, int], timeout_s: float = 120) -> None:
    """Until the registry lists `wanted` workers per role, and the router has had time to read it."""
    wait_for_registry(fleet.redis_url, wanted, timeout_s, still_alive=lambda: _check_alive(fleet))


def _environment(model: str, tls: TlsConfig, control: Host) -> dict[str, str]:
    return {**os.environ, **tls.tls_env(),
            "DISTSERVE_TLS_SERVER_NAME": SERVER_NAME,  # the certificate names `distserve`, not the hosts' IPs
            "DISTSERVE_MODEL": str(model), "DISTSERVE_DTYPE": "float32",
            "DISTSERVE_REDIS_URL": f"redis://{control.address}:{PORTS['redis']}/0",
            "DISTSERVE_BROKER_ADDRESS": f"{control.address}:{PORTS['kvbroker']}",
            "DISTSERVE_API_KEY": API_KEY, "UCX_TLS": "tcp", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def _python(module: str, host: Host, port: int, *args: str) -> list[str]:
    return ["-m", module, "--host", host.address, "--port", str(port), *args]


def _starter(testbed: Testbed, env: dict[str, str], logs: Path, services: dict[str, Service]):
    def start(name: str, host: Host, argv: list[str]) -> None:
        command = [sys.executable, *argv] if argv[0] == "-m" else argv
        log_path = logs / f"{name}.log"

        def spawn() -> subprocess.Popen:
            with open(log_path, "ab") as log_file:
                return subprocess.Popen(testbed.command(host, command), env=env, stdout=log_file,
                                        stderr=subprocess.STDOUT, cwd=ROOT)
        services[name] = Service(name, host, spawn(), log_path, spawn)
    return start


def _wait_redis(url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            redis.Redis.from_url(url, socket_timeout=1).ping()
            return
        except redis.RedisError:
            assert time.monotonic() < deadline, f"redis at {url} never answered"
            time.sleep(0.1)


def _wait_gateway(fleet: Fleet, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(fleet.gateway_url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        _check_alive(fleet)
        assert time.monotonic() < deadline, "the gateway never became healthy"
        time.sleep(0.2)


def _check_alive(fleet: Fleet) -> None:
    for service in fleet.services.values():
        if service.popen.poll() is not None:
            raise AssertionError(f"{service.name} exited ({service.popen.returncode}):\n"
                                 + service.log_path.read_text(errors="replace")[-3000:])
