"""The launcher's core split reaches the worker processes; other services stay unpinned."""

from __future__ import annotations

import os


def test_workers_run_on_their_cores_and_services_are_not_pinned(cluster):
    assert set(cluster.worker_cpus) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    for name, cpus in cluster.worker_cpus.items():
        process = cluster.processes[name]
        for thread_id in os.listdir(f"/proc/{process.popen.pid}/task"):
            assert os.sched_getaffinity(int(thread_id)) == set(cpus), (name, thread_id)
        environ = open(f"/proc/{process.popen.pid}/environ", "rb").read().split(b"\0")
        assert f"OMP_NUM_THREADS={len(cpus)}".encode() in environ
        assert f"pinned to cores {cpus}, torch threads {len(cpus)}" in process.log_path.read_text()
    for name in ("router", "kvbroker", "redis"):
        assert os.sched_getaffinity(cluster.processes[name].popen.pid) == os.sched_getaffinity(0), name
