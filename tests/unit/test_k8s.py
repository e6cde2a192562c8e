"""deploy/k8s: every overlay renders with `kubectl kustomize`, every object validates against the Kubernetes
1.32 API schemas (kubernetes-validate, offline, strict), and the manifests keep the properties the docs
promise: probes, non-root pods, drains that outlast their grace, budgets, network policies, autoscalers
on metrics the workers export, one GPU per worker in the GPU overlay; and they agree with the services:
every entrypoint exists, every flag and DISTSERVE_* variable they set is one a service reads, and every
probe is on the port the service serves."""

from __future__ import annotations

import dataclasses
import importlib
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from distserve.compose_secrets import HEALTH, env_name

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.32.0"
WORKERS = ("prefill", "decode")


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (kubectl kustomize); install kubectl"
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/k8s/overlays" / overlay)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request) -> list[dict]:
    return render(request.param)


def of_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def test_every_object_is_valid_against_the_api_schemas(objects):
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on the first problem


def test_everything_is_in_the_namespace_and_no_secret_is_committed(objects):
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"distserve"}
    assert not of_kind(objects, "Secret")  # keys, passwords and certificates are created by the operator


def test_every_container_has_probes_and_runs_unprivileged(objects):
    for name, deployment in of_kind(objects, "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        main = container(deployment)
        assert main.get("readinessProbe") and main.get("livenessProbe"), name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert main["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert main["securityContext"]["capabilities"]["drop"] == ["ALL"], name


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_workers_advertise_their_pod_ip_and_drain_within_the_grace_period(objects):
    deployments = of_kind(objects, "Deployment")
    for role in WORKERS:
        deployment = deployments[role]
        args = container(deployment)["args"]
        assert flag(args, "--advertise-host") == "$(POD_IP)"
        drain = float(flag(args, "--drain-s")) + float(flag(args, "--grace-s"))
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
        ports = {p["containerPort"] for p in container(deployment)["ports"]}
        assert int(flag(args, "--port")) in ports and int(flag(args, "--metrics-port")) in ports


def test_every_deployment_but_redis_has_a_disruption_budget(objects):
    budgets = of_kind(objects, "PodDisruptionBudget")
    for name in of_kind(objects, "Deployment"):
        if name != "redis":
            assert budgets[name]["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": name}


def test_ingress_is_denied_unless_a_policy_allows_it(objects):
    policies = of_kind(objects, "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    for name in of_kind(objects, "Deployment"):
        assert name in policies, f"no NetworkPolicy lets anything reach {name}"
    router_sources = [s["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                      for rule in policies["router"]["spec"]["ingress"] for s in rule["from"]]
    assert router_sources == ["gateway"]


def test_autoscalers_follow_metrics_the_workers_export(objects):
    source = (ROOT / "distserve/metrics.py").read_text()
    autoscalers = of_kind(objects, "HorizontalPodAutoscaler")
    assert set(autoscalers) == set(WORKERS)
    for name, hpa in autoscalers.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        (metric,) = hpa["spec"]["metrics"]
        exported = re.sub(r"^distserve_", "", metric["pods"]["metric"]["name"])
        assert f'PREFIX + "{exported}"' in source, f"{name}: no worker exports distserve:{exported}"


def test_the_gpu_overlay_gives_each_worker_one_gpu():
    deployments = of_kind(render("gpu"), "Deployment")
    for role in WORKERS:
        main = container(deployments[role])
        assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert {"name": "DISTSERVE_DEVICE", "value": "cuda"} in main["env"]
    assert "nvidia.com/gpu" not in str(container(deployments["router"]))


def test_redis_loads_a_user_per_role_and_every_service_presents_its_own(objects):
    deployments = of_kind(objects, "Deployment")
    redis = container(deployments["redis"])
    # the users from the operator's secret (compose-secrets' files: password hashes only), no password on a
    # command line (`ps`); the probes authenticate as a PING-only user through the environment
    assert redis["command"][:3] == ["redis-server", "--aclfile", "/etc/redis/users.acl"] and "args" not in redis
    (users,) = [v for v in deployments["redis"]["spec"]["template"]["spec"]["volumes"] if v["name"] == "users"]
    assert users["secret"] == {"secretName": "distserve-redis-users", "items": [{"key": "users.acl", "path": "users.acl"}]}
    health = {e["name"]: e for e in redis["env"]}["REDIS_HEALTH_PASSWORD"]
    assert health["valueFrom"]["secretKeyRef"] == {"name": "distserve-redis-users", "key": env_name(HEALTH)}
    for probe in ("readinessProbe", "livenessProbe"):
        assert "REDISCLI_AUTH=" in redis[probe]["exec"]["command"][-1]
        assert "--user health" in redis[probe]["exec"]["command"][-1]
    for name, deployment in deployments.items():
        if name == "redis":
            continue
        env = {e["name"]: e for e in container(deployment).get("env", [])}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "distserve-redis-users",
                                                                      "key": env_name(name)}, name
        assert env["DISTSERVE_REDIS_URL"]["value"] == f"redis://{name}:$(REDIS_PASSWORD)@redis:6379/0", name
        names = [e["name"] for e in container(deployment)["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("DISTSERVE_REDIS_URL"), name  # $(...) sees only earlier


# The module each manifest runs -> its config class and the prefix of its environment variables.
CONFIGS = {"services.router": ("services.router.config", "RouterConfig", "DISTSERVE_ROUTER_"),
           "services.router.gateway": ("services.router.gateway.config", "GatewayConfig", "DISTSERVE_GATEWAY_"),
           "services.kvbroker": ("services.kvbroker.config", "KvBrokerConfig", "DISTSERVE_KVBROKER_"),
           "services.prefill": ("services.prefill.config", "PrefillConfig", "DISTSERVE_PREFILL_"),
           "services.decode": ("services.decode.config", "DecodeConfig", "DISTSERVE_DECODE_"),
           "services.colocated": ("services.colocated.config", "ColocatedConfig", "DISTSERVE_COLOCATED_")}


def config_of(module: str):
    """(config class, env prefix) of a service module, checked against what its __main__ parses."""
    path, name, prefix = CONFIGS[module]
    source = (ROOT / module.replace(".", "/") / "__main__.py").read_text()
    assert f'parse_config({name}, argv, prefix="{prefix}")' in source, f"{module} no longer parses {name}"
    return getattr(importlib.import_module(path), name), prefix


def known_environment() -> set[str]:
    """Every DISTSERVE_* variable something reads: config fields' names, and names in the sources."""
    from distserve.config import env_name
    names = set()
    for module in CONFIGS:
        cls, prefix = config_of(module)
        names |= {env_name(field, prefix) for field in dataclasses.fields(cls)}
    for folder in ("distserve", "services"):
        for source in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r'"(DISTSERVE_[A-Z0-9_]+)"', source.read_text()))
    return names


def test_manifests_run_real_entrypoints_with_real_flags_variables_and_probe_ports(objects):
    known = known_environment()
    shared = {key for o in of_kind(objects, "ConfigMap").values() for key in o.get("data", {})}
    assert {name for name in shared if name.startswith("DISTSERVE_")} <= known
    for name, deployment in of_kind(objects, "Deployment").items():
        main = container(deployment)
        argv = main.get("command", []) + main.get("args", [])
        if "-m" not in argv:
            continue  # redis
        module = argv[argv.index("-m") + 1]
        assert (ROOT / module.replace(".", "/") / "__main__.py").is_file(), f"{name}: no entrypoint {module}"
        cls, _ = config_of(module)
        flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(cls) if f.metadata.get("flag", True)}
        assert {a for a in argv if a.startswith("--")} <= flags, f"{name}: flags {module} does not take"
        env = {e["name"] for e in main.get("env", []) if e["name"].startswith("DISTSERVE_")}
        assert env <= known, f"{name}: variables nothing reads: {env - known}"
        ports = {p["containerPort"] for p in main["ports"]} | {p["name"] for p in main["ports"]}
        serving = int(flag(argv, "--port"))
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe not in main:
                continue
            target = main[probe].get("grpc", main[probe].get("httpGet"))
            assert target["port"] in ports, f"{name}: {probe} on port {target['port']}, not one it declares"
            named = {p["name"]: p["containerPort"] for p in main["ports"]}
            assert named.get(target["port"], target["port"]) == serving, f"{name}: {probe} misses --port"
