"""The compose file publishes only the gateway and the UIs; everything else stays on its network. Prometheus
scrapes every service's metrics port, and Grafana is provisioned with it and the dashboard."""

from __future__ import annotations

import dataclasses
import importlib
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from distserve import redis_acl
from distserve.compose_secrets import HEALTH, env_name

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "deploy" / "compose" / "docker-compose.yml"
# every user the compose file names (compose-secrets writes these and the administrator's)
REDIS_PASSWORDS = {env_name(user): f"pw-{user}" for user in (*redis_acl.ROLES, HEALTH) if user != redis_acl.ADMIN}
PUBLISHED = {"gateway": {8000}, "jaeger": {16686}, "grafana": {3000}}
# The module each service runs -> (its config class, the config field holding its metrics port).
METRICS_PORT = {"services.router": ("services.router.config:RouterConfig", "metrics_port"),
                "services.kvbroker": ("services.kvbroker.config:KvBrokerConfig", "metrics_port"),
                "services.prefill": ("services.prefill.config:PrefillConfig", "metrics_port"),
                "services.decode": ("services.decode.config:DecodeConfig", "metrics_port"),
                "services.colocated": ("services.colocated.config:ColocatedConfig", "metrics_port"),
                "services.router.gateway": ("services.router.gateway.config:GatewayConfig", "port")}


def _docker_compose() -> str:
    """The docker-compose binary; installed with apt when missing and root (CI installs it), else a failure."""
    found = shutil.which("docker-compose")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "docker-compose"], check=False, capture_output=True,
                       timeout=600)
        found = shutil.which("docker-compose")
    assert found, "docker-compose is not installed (apt-get install -y docker-compose)"
    return found


@pytest.fixture(scope="module")
def services() -> dict:
    """The services of `docker-compose config` (with the colocated profile): what compose would run."""
    reply = subprocess.run([_docker_compose(), "-f", str(COMPOSE_FILE), "--profile", "colocated", "config"],
                           capture_output=True, text=True, timeout=120,
                           env={**_without_publish_settings(), "GRAFANA_ADMIN_PASSWORD": "compose-test",
                                **REDIS_PASSWORDS})
    assert reply.returncode == 0, reply.stderr
    return yaml.safe_load(reply.stdout)["services"]


def _without_publish_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("DISTSERVE_PUBLISH_ADDR", "GRAFANA_ADMIN_PASSWORD") and not k.startswith("DISTSERVE_REDIS_PASSWORD")}


def test_published_ports_bind_the_hosts_loopback_unless_told(services):
    for name in PUBLISHED:
        for entry in services[name]["ports"]:
            host_ip = entry["host_ip"] if isinstance(entry, dict) else str(entry).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name} publishes {entry} beyond the host's loopback"


def test_grafana_has_no_default_password():
    reply = subprocess.run([_docker_compose(), "-f", str(COMPOSE_FILE), "config", "-q"], capture_output=True, text=True,
                           timeout=120, env={**_without_publish_settings(), **REDIS_PASSWORDS})
    assert reply.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in reply.stderr


def test_compose_refuses_to_start_without_the_redis_users():
    for missing in ("DISTSERVE_REDIS_PASSWORD_ROUTER", "DISTSERVE_REDIS_PASSWORD_HEALTH"):
        env = {**_without_publish_settings(), "GRAFANA_ADMIN_PASSWORD": "compose-test", **REDIS_PASSWORDS}
        del env[missing]
        reply = subprocess.run([_docker_compose(), "-f", str(COMPOSE_FILE), "config", "-q"], capture_output=True,
                               text=True, timeout=120, env=env)
        assert reply.returncode != 0 and missing in reply.stderr and "compose-secrets" in reply.stderr


def test_redis_loads_a_user_per_role_and_every_service_presents_its_own(services):
    redis_service = services["redis"]
    # the users come from the ACL file compose-secrets wrote (hashes only); no password on any command line
    assert redis_service["command"][:3] == ["redis-server", "--aclfile", "/etc/redis/users.acl"]
    assert any(str(v).endswith(":/etc/redis/users.acl:ro,z") or (isinstance(v, dict) and v.get("target") ==
               "/etc/redis/users.acl") for v in redis_service["volumes"])
    assert not any(password in " ".join(redis_service["command"]) for password in REDIS_PASSWORDS.values())
    assert redis_service["environment"] == {"DISTSERVE_REDIS_PASSWORD_HEALTH": "pw-health"}  # may only PING
    assert "--user health" in " ".join(redis_service["healthcheck"]["test"])
    roles = {"kvbroker": "kvbroker", "kvbroker-2": "kvbroker", "prefill": "prefill", "decode": "decode",
             "colocated": "colocated", "router": "router", "router-2": "router", "gateway": "gateway"}
    for name, service in services.items():
        if str(service.get("image", "")).startswith("distserve"):
            role = roles[name]
            assert service["environment"]["DISTSERVE_REDIS_URL"] == f"redis://{role}:pw-{role}@redis:6379/0", name


def _published_ports(service: dict) -> set[int]:
    """Host ports a service publishes, from `docker-compose config` (short or long syntax)."""
    ports = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports.add(int(entry["published"]))
        else:
            ports.add(int(str(entry).split("/")[0].split(":")[-2]))
    return ports


def test_compose_publishes_only_the_gateway_and_the_uis(services):
    assert {"redis", "kvbroker", "router", "prefill", "decode", "colocated", "gateway", "prometheus",
            "grafana"} <= set(services)
    published = {name: _published_ports(service) for name, service in services.items()}
    assert {name: ports for name, ports in published.items() if ports} == PUBLISHED


def _metrics_port(service: dict) -> tuple[str, int] | None:
    """(module, metrics port) of a distserve service: --metrics-port (or the gateway's --port) in its command,
    else the environment variable, else the config default; None for a service not run from `services.*`."""
    argv = service.get("command") or []
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2])
    if "-m" not in argv or argv[argv.index("-m") + 1] not in METRICS_PORT:
        return None
    module = argv[argv.index("-m") + 1]
    path, field = METRICS_PORT[module]
    module_name, _, class_name = path.partition(":")
    config = getattr(importlib.import_module(module_name), class_name)
    flag = "--" + field.replace("_", "-")
    if flag in argv:
        return module, int(argv[argv.index(flag) + 1])
    prefix = "DISTSERVE_" + module.rpartition(".")[2].upper() + "_"
    env = (service.get("environment") or {}).get(prefix + field.upper())
    default = next(f.default for f in dataclasses.fields(config) if f.name == field)
    return module, int(env) if env else default


def _scraped(config: dict) -> dict[str, set[str]]:
    """host:port targets of each job: static targets, and DNS names with their port."""
    jobs = {}
    for job in config["scrape_configs"]:
        targets = {t for static in job.get("static_configs", []) for t in static["targets"]}
        targets |= {f"{name}:{dns['port']}" for dns in job.get("dns_sd_configs", []) for name in dns["names"]}
        jobs[job["job_name"]] = targets
    return jobs


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            source, target = volume.get("source", ""), volume["target"]
        else:
            source, target = volume.split(":")[:2]
        if source.startswith("/"):
            mounts[target] = Path(source)
    return mounts


def test_prometheus_scrapes_every_service_at_its_metrics_port(services):
    mounts = _mounts(services["prometheus"])
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    jobs = _scraped(config)
    expected: dict[str, set[str]] = {}  # job (a replica's job is its first's) -> targets
    for name, service in services.items():
        found = _metrics_port(service)
        if found is not None:
            expected.setdefault(name.removesuffix("-2"), set()).add(f"{name}:{found[1]}")
    assert set(expected) == {"kvbroker", "router", "prefill", "decode", "colocated", "gateway"}
    assert jobs == expected


def test_two_kvbrokers_and_two_routers_run_and_every_client_is_told_both(services):
    assert {"kvbroker-2", "router-2"} <= set(services)
    for replica in ("kvbroker", "router"):
        assert services[f"{replica}-2"]["command"] == services[replica]["command"]
    environment = services["gateway"]["environment"]
    assert environment["DISTSERVE_ROUTER_ADDRESS"] == "router:50051,router-2:50051"
    for name in ("router", "router-2", "prefill", "decode"):
        assert services[name]["environment"]["DISTSERVE_BROKER_ADDRESS"] == "kvbroker:50060,kvbroker-2:50060"


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard(services):
    mounts = _mounts(services["grafana"])
    provisioning = mounts["/etc/grafana/provisioning"]
    [datasource] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert (datasource["type"], datasource["url"], datasource["uid"]) == ("prometheus", "http://prometheus:9090",
                                                                           "prometheus")
    assert "prometheus" in services["grafana"]["depends_on"]
    [provider] = yaml.safe_load((provisioning / "dashboards" / "distserve.yml").read_text())["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert (dashboards / "distserve.json").is_file()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/distserve.json"


def test_the_image_runs_services_as_an_unprivileged_user_who_owns_the_cache(services):
    """The Dockerfile's last USER is not root, and it owns /cache before the volume is declared; compose sets
    no user that would override it."""
    lines = (ROOT / "deploy" / "compose" / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    uid = users[-1].split(":")[0]
    volume = next(i for i, line in enumerate(lines) if line.startswith("VOLUME /cache"))
    assert any(f"chown {uid}:" in line and "/cache" in line for line in lines[:volume])
    assert all(services[name].get("user") in (None, uid) for name in ("router", "kvbroker", "prefill", "decode",
                                                                      "gateway", "colocated"))
