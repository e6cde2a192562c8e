"""The launcher starts the gateway alongside the routers: should a router move to other ports before it
serves, the gateway is started again pointing at the router's new address."""

from __future__ import annotations

import sys

from distserve.launcher import Cluster, ClusterSpec, ManagedProcess

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def cluster_with_router(tmp_path, router_address: str) -> Cluster:
    cluster = Cluster(ClusterSpec(model="unused", num_prefill=0, num_decode=0, log_dir=str(tmp_path)))
    cluster.processes["router"] = ManagedProcess("router", None, tmp_path / "router.log", [], {},  # type: ignore[arg-type]
                                                 address=router_address)
    return cluster


def spawn_sleeping_gateway(cluster: Cluster) -> ManagedProcess:
    """A stand-in gateway process with the launcher's gateway environment."""
    return cluster._spawn("gateway", list(SLEEPER), cluster._gateway_env())


def test_a_gateway_whose_router_stayed_put_is_left_running(tmp_path):
    cluster = cluster_with_router(tmp_path, "127.0.0.1:5001")
    gateway = spawn_sleeping_gateway(cluster)
    first = gateway.popen
    try:
        cluster._point_gateway_at_routers(gateway)
        assert gateway.popen is first and first.poll() is None
    finally:
        gateway.popen.kill()


def test_a_router_that_moved_gets_the_gateway_started_again_at_its_new_address(tmp_path):
    cluster = cluster_with_router(tmp_path, "127.0.0.1:5001")
    gateway = spawn_sleeping_gateway(cluster)
    first = gateway.popen
    cluster.processes["router"].address = "127.0.0.1:5002"  # as _move_to_free_ports does
    try:
        cluster._point_gateway_at_routers(gateway)
        assert first.poll() is not None, "the gateway with the old address still runs"
        assert gateway.popen is not first and gateway.popen.poll() is None
        assert gateway.env["DISTSERVE_ROUTER_ADDRESS"] == "127.0.0.1:5002"
    finally:
        gateway.popen.kill()
        first.kill()
