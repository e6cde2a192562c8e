"""Lent cores (`distserve up --lend-cores`): prefill and decode workers run on every core, decode at a
lower CPU priority, so the kernel gives a running prefill forward every core and decode steps the rest.
Output stays token-exact; the priorities and both forward teams' binding are on the threads the kernel
schedules."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import pytest

from distserve.cpus import session_group_nice
from distserve.engine.model_loader import load_model
from distserve.launcher import LENT_CORES_NICE, Cluster, ClusterSpec
from tests.builders import compare_with_tolerance, generate, reference_generate, token_request
from tests.integration.conftest import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, assert_clean, wait_for_workers
from tests.integration.test_correctness import MAX_TOKENS, make_prompts


@pytest.fixture(scope="module")
def lending(tiny_model_path, tmp_path_factory):
    free_ports = {f.name: 0 for f in dataclasses.fields(ClusterSpec) if f.name.endswith("_port")}
    spec = ClusterSpec(model=tiny_model_path, num_prefill=1, num_decode=1, lend_cores=True, **free_ports,
                       log_dir=str(tmp_path_factory.mktemp("lend-logs")),
                       prefill_args=PREFILL_TEST_ARGS, decode_args=DECODE_TEST_ARGS, env={"DISTSERVE_DTYPE": "float32"})
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 1, 1)
    yield cluster
    cluster.stop()


def thread_stats(pid: int) -> list[tuple[int, str, int]]:
    """(thread id, name, nice) of each thread of a process (nice: field 19 of /proc/PID/task/TID/stat)."""
    stats = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as stat:
            comm_end = (text := stat.read()).rindex(")")
            stats.append((int(tid), text[text.index("(") + 1:comm_end], int(text[comm_end + 2:].split()[16])))
    return stats


def thread_nices(pid: int) -> dict[str, int]:
    return {name: nice for _, name, nice in thread_stats(pid)}


def thread_ids(pid: int, name: str) -> list[int]:
    return [tid for tid, comm, _ in thread_stats(pid) if comm == name]


def test_requests_stay_token_exact_and_all_but_prefill_run_at_the_lower_priority(lending, tiny_model_path):
    reference_model = load_model(tiny_model_path, "float32", "cpu")
    prompts = make_prompts(reference_model.config.vocab_size)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # at once: prefill and decode overlap
        answers = list(pool.map(
            lambda p: generate(lending.router_address, token_request(p, max_tokens=MAX_TOKENS)), prompts))
    for prompt, answer in zip(prompts, answers):
        ok, _ = compare_with_tolerance(answer.token_ids, reference_generate(reference_model, prompt, MAX_TOKENS))
        assert ok, (len(prompt), answer.token_ids)
    cores = sorted(os.sched_getaffinity(0))
    assert lending.worker_cpus["prefill-0"] == cores and lending.worker_cpus["decode-0"] == cores
    base = os.getpriority(os.PRIO_PROCESS, 0)
    decode_pid, prefill_pid = (lending.processes[name].popen.pid for name in ("decode-0", "prefill-0"))
    decode, prefill = thread_nices(decode_pid), thread_nices(prefill_pid)
    assert "decode-step" in decode and set(decode.values()) == {min(base + LENT_CORES_NICE, 19)}, decode
    assert "prefill-forward" in prefill and set(prefill.values()) == {base}, prefill
    control = {name: set(thread_nices(lending.processes[name].popen.pid).values())
               for name in ("redis", "kvbroker", "router", "gateway")}
    assert control == {name: {min(base + LENT_CORES_NICE, 19)} for name in control}  # decode's equals
    if os.path.exists(f"/proc/{decode_pid}/autogroup"):  # the kernel shares the CPU between sessions first
        # each child leads its own session, so each has a group of its own (never the empty root one)
        groups = {name: session_group_nice(f"/proc/{process.popen.pid}/autogroup")
                  for name, process in lending.processes.items()}
        assert groups == {name: 0 if name == "prefill-0" else LENT_CORES_NICE for name in groups}
    for pid, name in ((prefill_pid, "prefill-forward"), (decode_pid, "decode-step")):
        team_cores = sorted(tuple(sorted(os.sched_getaffinity(tid))) for tid in thread_ids(pid, name))
        assert team_cores == [(core,) for core in cores], name  # each forward's team: one thread per core
    assert_clean(lending)
