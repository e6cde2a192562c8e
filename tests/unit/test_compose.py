"""The compose file publishes only the gateway and the Jaeger UI; everything else stays on its network."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "docker-compose.yml"
PUBLISHED = {"gateway": {8000}, "jaeger": {16686}}


def _docker_compose() -> str:
    """The docker-compose binary; installed with apt when missing and root (CI installs it), else a failure."""
    found = shutil.which("docker-compose")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "docker-compose"], check=False, capture_output=True,
                       timeout=600)
        found = shutil.which("docker-compose")
    assert found, "docker-compose is not installed (apt-get install -y docker-compose)"
    return found


def _published_ports(service: dict) -> set[int]:
    """Host ports a service publishes, from `docker-compose config` (short or long syntax)."""
    ports = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports.add(int(entry["published"]))
        else:
            ports.add(int(str(entry).split("/")[0].split(":")[-2]))
    return ports


def test_compose_publishes_only_the_gateway_and_jaeger_ui():
    reply = subprocess.run([_docker_compose(), "-f", str(COMPOSE_FILE), "--profile", "colocated", "config"],
                           capture_output=True, text=True, timeout=120)
    assert reply.returncode == 0, reply.stderr
    services = yaml.safe_load(reply.stdout)["services"]
    assert {"redis", "kvbroker", "router", "prefill", "decode", "colocated", "gateway"} <= set(services)
    published = {name: _published_ports(service) for name, service in services.items()}
    assert {name: ports for name, ports in published.items() if ports} == PUBLISHED
