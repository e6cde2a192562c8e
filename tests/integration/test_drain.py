"""Draining by RPC: a Drain call does what SIGTERM does (in-flight streams finish, the worker exits 0),
and `distserve restart` drains a supervised fleet's workers one at a time while a stream runs through
it, without changing that stream's output."""

from __future__ import annotations

import dataclasses
import threading

from distserve import cli, cluster_state
from distserve.client import DistServeSyncClient, FinishReason
from distserve.launcher import Cluster, ClusterSpec, free_port
from tests.cluster_helpers import drain
from tests.integration.conftest import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, WORKER_LEASE_S, wait_for_workers


def test_a_drain_call_lets_an_in_flight_stream_finish_and_the_worker_exits_0(cluster):
    port = free_port()
    args = ["--lease-s", str(WORKER_LEASE_S), "--heartbeat-s", "0.5", "--kv-cache-mb", "128", "--drain-s", "1"]
    spare = cluster.start_service("decode-rpc-drain", "services.decode", f"127.0.0.1:{port}", args)
    cluster.wait_healthy(spare, 120)
    wait_for_workers(cluster, 2, 3)
    try:
        with DistServeSyncClient(cluster.router_address, timeout_s=300) as client:
            stream = client.generate([33, 34, 35], max_tokens=400, temperature=0, ignore_eos=True)
            first = next(stream)
            assert first.decode_worker == f"decode-127.0.0.1-{port}"  # the spare has the most free blocks
            reply = drain(spare.address)
            assert (reply.drain_s, reply.grace_s, reply.already_draining) == (1.0, 60.0, False)
            assert drain(spare.address).already_draining  # still accepting calls for drain_s
            rest = list(stream)
        assert sum(len(c.token_ids) for c in [first, *rest]) == 400
        assert rest[-1].finish_reason is FinishReason.LENGTH
        assert spare.popen.wait(timeout=60) == 0
    finally:
        if spare.popen.poll() is None:
            cluster.kill("decode-rpc-drain")
        del cluster.processes["decode-rpc-drain"]


def test_a_rolling_restart_renews_every_worker_under_a_running_stream(tiny_model_path, tmp_path):
    free_ports = {f.name: 0 for f in dataclasses.fields(ClusterSpec) if f.name.endswith("_port")}
    free_ports["gateway_port"] = None
    spec = ClusterSpec(model=tiny_model_path, num_prefill=1, num_decode=2, **free_ports,
                       log_dir=str(tmp_path / "logs"), state_file=str(tmp_path / "up.json"), supervise=True,
                       prefill_args=PREFILL_TEST_ARGS + ["--drain-s", "0.5"],
                       decode_args=DECODE_TEST_ARGS + ["--drain-s", "0.5"],
                       env={"DISTSERVE_DTYPE": "float32"})
    cluster = Cluster(spec).start()
    try:
        wait_for_workers(cluster, 1, 2)
        prompt = [50, 51, 52, 53]
        with DistServeSyncClient(cluster.router_address, timeout_s=300) as client:
            unfailed = [t for c in client.generate(prompt, max_tokens=1200, temperature=0, ignore_eos=True)
                        for t in c.token_ids]
            before = {c["name"]: c["pid"] for c in cluster_state.read(tmp_path / "up.json")["children"]}
            stream = client.generate(prompt, max_tokens=1200, temperature=0, ignore_eos=True)
            chunks = [next(stream)]
            restarted = []
            roll = threading.Thread(target=lambda: restarted.append(
                cli.main(["restart", "--state-file", str(tmp_path / "up.json")])))
            roll.start()
            chunks += list(stream)
            roll.join(timeout=300)
            assert restarted == [0]
            assert [t for c in chunks for t in c.token_ids] == unfailed
            after = {c["name"]: c["pid"] for c in cluster_state.read(tmp_path / "up.json")["children"]}
            workers = ("prefill-0", "decode-0", "decode-1")
            assert all(after[name] != before[name] for name in workers)
            assert after["router"] == before["router"]
            again = [t for c in client.generate(prompt, max_tokens=1200, temperature=0, ignore_eos=True)
                     for t in c.token_ids]
            assert again == unfailed
    finally:
        cluster.stop()
