"""Cores per worker: parsing --cpus, the launcher's split, pinning this process, and the worker configs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from distserve import cpus as cpus_module
from distserve.config import ConfigError, parse_config
from distserve.cpus import (AUTOGROUP_PATH, apply_cpus, bind_openmp_team, format_cpu_list, parse_cpu_list, pin_process,
                            process_tree, session_group_nice, split_cores)
from distserve.engine.compute_thread import ComputeThread
from distserve.launcher import (LENT_CORES_NICE, Cluster, ClusterSpec, plan_control_cpus, plan_nice,
                               plan_worker_cpus)
from services.colocated.config import ColocatedConfig
from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text, cpus", [
    ("0", [0]), ("2-3", [2, 3]), ("0,2-3", [0, 2, 3]), (" 1 , 4-6 ", [1, 4, 5, 6]), ("3,1,1", [1, 3]),
])
def test_parse_cpu_list(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "0,", ",1", "1-", "-1", "3-2", "0;1", "1.5", "0-1-2"])
def test_parse_cpu_list_rejects_bad_input_naming_the_field(text):
    with pytest.raises(ValueError, match=r"^cpus: "):
        parse_cpu_list(text)
    with pytest.raises(ConfigError, match=r"^spec\.cpus: "):
        parse_cpu_list(text, "spec.cpus")


@pytest.mark.parametrize("available, num_prefill, num_decode, expected", [
    ([0, 1], 1, 1, [[0], [1]]),
    ([0, 1, 2, 3], 1, 1, [[0, 1], [2, 3]]),
    ([0, 1, 2, 3], 2, 2, [[0], [1], [2], [3]]),
    ([0, 1, 2], 1, 1, [[0, 1], [2]]),  # the spare core goes to prefill
    ([4, 5, 6, 7, 8], 1, 2, [[4, 5], [6, 7], [8]]),
    ([2, 3], 0, 1, [[2, 3]]),
    ([0, 1], 0, 0, []),
])
def test_split_gives_each_worker_its_own_cores(available, num_prefill, num_decode, expected, caplog):
    with caplog.at_level(logging.WARNING, logger="distserve.cpus"):
        split = split_cores(available, num_prefill, num_decode)
    assert split == expected
    used = [cpu for cpus in split for cpu in cpus]
    assert len(used) == len(set(used))  # disjoint
    assert not caplog.records


@pytest.mark.parametrize("available, num_prefill, num_decode, expected", [
    ([0], 1, 1, [[0], [0]]),
    ([0, 1], 2, 2, [[0], [1], [0], [1]]),
    ([5, 6], 2, 1, [[5], [6], [5]]),
])
def test_split_with_too_few_cores_shares_round_robin_and_warns(available, num_prefill, num_decode, expected,
                                                                caplog):
    with caplog.at_level(logging.WARNING, logger="distserve.cpus"):
        assert split_cores(available, num_prefill, num_decode) == expected
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "share cores" in caplog.text


def test_launcher_names_each_workers_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))  # a machine with 8 cores
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=2, cpus="0-3")
    assert plan_worker_cpus(spec) == {"prefill-0": [0, 1], "decode-0": [2], "decode-1": [3]}
    shared = ClusterSpec(model="m", num_prefill=1, num_decode=1, cpus="0-3", share_cores=True)
    assert plan_worker_cpus(shared) == {"prefill-0": [0, 1, 2, 3], "decode-0": [0, 1, 2, 3]}


def test_taking_turns_gives_prefill_every_core_and_decode_its_share(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    two = ClusterSpec(model="m", num_prefill=1, num_decode=1, cpus="0-1", take_turns=True)
    assert plan_worker_cpus(two) == {"prefill-0": [0, 1], "decode-0": [1]}
    four = ClusterSpec(model="m", num_prefill=1, num_decode=2, cpus="0-3", take_turns=True)
    assert plan_worker_cpus(four) == {"prefill-0": [0, 1, 2, 3], "decode-0": [2], "decode-1": [3]}


def test_lending_cores_puts_prefill_and_decode_on_every_core_and_colocated_on_its_share(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    two = ClusterSpec(model="m", num_prefill=1, num_decode=1, cpus="0-1", lend_cores=True)
    assert plan_worker_cpus(two) == {"prefill-0": [0, 1], "decode-0": [0, 1]}
    mixed = ClusterSpec(model="m", num_prefill=1, num_decode=1, num_colocated=1, cpus="0-2", lend_cores=True)
    assert plan_worker_cpus(mixed) == {"prefill-0": [0, 1, 2], "decode-0": [0, 1, 2], "colocated-0": [2]}


def spawned_pair(monkeypatch, spec: ClusterSpec) -> tuple[Cluster, dict[str, tuple[list[str], dict[str, str]]]]:
    """The argv and environment the launcher gives prefill-0, decode-0 and the router under `spec`
    (nothing is started)."""
    spawned = {}

    def fake_spawn(self, name, argv, env=None):
        spawned[name] = (argv, env or {})
        return types.SimpleNamespace()

    monkeypatch.setattr(Cluster, "_spawn", fake_spawn)
    cluster = Cluster(spec)
    for name, module in (("prefill-0", "services.prefill"), ("decode-0", "services.decode"),
                         ("router", "services.router")):
        cluster.start_service(name, module, "127.0.0.1:1", [], metrics_port=2)
    return cluster, spawned


def test_on_lent_cores_all_but_the_prefilling_workers_start_at_a_lower_priority():
    children = ["redis", "kvbroker", "router", "gateway", "prefill-0", "prefill-1", "decode-0", "colocated-0"]
    lent = {name: plan_nice(ClusterSpec(model="m", lend_cores=True), name) for name in children}
    assert lent == {name: 0 if name.startswith(("prefill-", "colocated-")) else LENT_CORES_NICE for name in children}
    assert {plan_nice(ClusterSpec(model="m"), name) for name in children} == {0}


def test_lent_cores_give_no_worker_a_nice_flag_or_a_lock(monkeypatch, tmp_path):
    """The launcher lowers decode before exec: a --nice flag as well would lower it twice."""
    _, spawned = spawned_pair(monkeypatch, ClusterSpec(model="m", log_dir=str(tmp_path), lend_cores=True))
    assert not any("--nice" in argv for argv, _ in spawned.values())
    assert not any("--core-turns" in argv for argv, _ in spawned.values())  # no lock: the kernel decides


def test_children_start_at_their_planned_priority_with_their_own_sessions_group(tmp_path):
    """A real child from the launcher's spawn path: niced before exec, its session's group too (where
    the kernel has autogroups); a prefill worker keeps the launcher's priority."""
    cluster = Cluster(ClusterSpec(model="m", num_prefill=1, num_decode=1, lend_cores=True, log_dir=str(tmp_path)))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    children = {name: cluster._spawn(name, sleeper) for name in ("router", "prefill-0")}
    base = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        nices = {name: os.getpriority(os.PRIO_PROCESS, child.popen.pid) for name, child in children.items()}
        assert nices == {"router": min(base + LENT_CORES_NICE, 19), "prefill-0": base}
        if os.path.exists(AUTOGROUP_PATH):
            groups = {name: session_group_nice(f"/proc/{child.popen.pid}/autogroup")
                      for name, child in children.items()}
            assert groups == {"router": LENT_CORES_NICE, "prefill-0": 0}  # a new session's group starts at 0
    finally:
        for child in children.values():
            child.popen.kill()
            child.popen.wait()


def test_workers_taking_turns_share_one_turns_folder_and_spin_briefly(monkeypatch, tmp_path):
    """Prefill and decode workers get the same --core-turns folder and a short OpenMP spin; the
    router gets neither, and without --take-turns no worker does."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    for take_turns in (True, False):
        spec = ClusterSpec(model="m", log_dir=str(tmp_path / str(take_turns)), take_turns=take_turns)
        cluster, spawned = spawned_pair(monkeypatch, spec)
        folders = {name: argv[argv.index("--core-turns") + 1] for name, (argv, _) in spawned.items()
                   if "--core-turns" in argv}
        spins = {name: env["GOMP_SPINCOUNT"] for name, (_, env) in spawned.items() if "GOMP_SPINCOUNT" in env}
        if take_turns:
            assert folders == {"prefill-0": str(cluster.log_dir / "core-turns"),
                               "decode-0": str(cluster.log_dir / "core-turns")}
            assert spins == {"prefill-0": "10000", "decode-0": "10000"}
        else:
            assert folders == {} and spins == {}


def test_launcher_defaults_to_the_cores_it_may_use():
    allowed = sorted(os.sched_getaffinity(0))
    plan = plan_worker_cpus(ClusterSpec(model="m", num_prefill=1, num_decode=1))
    assert plan == dict(zip(["prefill-0", "decode-0"], split_cores(allowed, 1, 1)))


def test_launcher_rejects_cores_it_may_not_use():
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=r"^cpus: .*not available"):
        plan_worker_cpus(ClusterSpec(model="m", cpus=str(missing)))


def test_control_plane_children_float_while_starting_then_run_on_the_control_cpus(tmp_path):
    """Router, gateway, kvbroker and Redis (real children, from the launcher's own spawn path) may use every
    core until the start ends, then run on --control-cpus, as does one restarted later; workers are left
    to pin themselves from their --cpus."""
    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    cluster = Cluster(ClusterSpec(model="m", num_prefill=1, num_decode=1, control_cpus=str(core),
                                  log_dir=str(tmp_path)))
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    # a router that starts a process of its own while floating (as its grammar worker): pinned too
    parent = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
              "'import time; time.sleep(60)']); time.sleep(60)"]
    router, prefill = cluster._spawn("router", parent), cluster._spawn("prefill-0", sleeper)
    try:
        assert os.sched_getaffinity(router.popen.pid) == allowed
        deadline = time.monotonic() + 10
        while len(process_tree([router.popen.pid])) < 2:
            assert time.monotonic() < deadline, "the router's child did not start"
            time.sleep(0.05)
        child = process_tree([router.popen.pid])[1]
        assert os.sched_getaffinity(child) == allowed
        cluster._pin_control_plane()
        assert os.sched_getaffinity(router.popen.pid) == {core} and os.sched_getaffinity(child) == {core}
        assert os.sched_getaffinity(prefill.popen.pid) == allowed
        router.popen.kill()
        router.popen.wait()
        cluster.respawn(router)  # as the supervisor restarts it
        assert os.sched_getaffinity(router.popen.pid) == {core}
    finally:
        for pid in process_tree([router.popen.pid])[1:]:
            os.kill(pid, signal.SIGKILL)
        for process in (router, prefill):
            process.popen.kill()
            process.popen.wait()


def test_an_unpinned_control_plane_is_left_unpinned_when_the_start_ends(tmp_path):
    cluster = Cluster(ClusterSpec(model="m", num_prefill=0, num_decode=0, num_colocated=2, log_dir=str(tmp_path)))
    assert cluster.control_cpus is None
    router = cluster._spawn("router", [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cluster._pin_control_plane()
        assert os.sched_getaffinity(router.popen.pid) == os.sched_getaffinity(0)
    finally:
        router.popen.kill()
        router.popen.wait()


def test_control_cpus_default_to_unpinned_and_must_exist():
    assert plan_control_cpus(ClusterSpec(model="m")) is None
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=r"^control_cpus: .*not available"):
        plan_control_cpus(ClusterSpec(model="m", control_cpus=str(missing)))
    with pytest.raises(ConfigError, match=r"^control_cpus: "):
        plan_control_cpus(ClusterSpec(model="m", control_cpus="one"))


def test_auto_control_cpus_take_spare_cores_else_the_decode_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert plan_control_cpus(ClusterSpec(model="m", control_cpus="auto")) == [2, 3]  # 1+1: [[0, 1], [2, 3]]
    assert plan_control_cpus(ClusterSpec(model="m", num_prefill=2, num_decode=2, control_cpus="auto")) == [2, 3]
    assert plan_control_cpus(ClusterSpec(model="m", cpus="0-2", control_cpus="auto")) == [3]  # core 3 is spare
    only_colocated = ClusterSpec(model="m", num_prefill=0, num_decode=0, num_colocated=1, control_cpus="auto")
    assert plan_control_cpus(only_colocated) is None
    assert plan_control_cpus(ClusterSpec(model="m", control_cpus="any")) is None


def test_up_pins_the_control_plane_automatically_unless_told_otherwise(tiny_model_path):
    from distserve import cli

    parser = argparse.ArgumentParser()
    cli._add_cluster_args(parser)
    assert cli._spec(parser.parse_args(["--model", tiny_model_path])).control_cpus == "auto"
    assert cli._spec(parser.parse_args(["--model", tiny_model_path, "--control-cpus", "any"])).control_cpus == "any"


@pytest.fixture
def restore_affinity_and_threads():
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    pin_process(sorted(affinity))
    torch.set_num_threads(threads)


def test_pin_process_to_the_current_mask_keeps_it_and_sets_threads(restore_affinity_and_threads):
    current = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(current) + 3)
    pin_process(current)
    assert sorted(os.sched_getaffinity(0)) == current
    assert torch.get_num_threads() == len(current)


def test_pin_process_narrows_every_thread(restore_affinity_and_threads):
    core = min(os.sched_getaffinity(0))
    pin_process([core])
    assert os.sched_getaffinity(0) == {core}
    for thread_id in os.listdir("/proc/self/task"):
        assert os.sched_getaffinity(int(thread_id)) == {core}
    assert torch.get_num_threads() == 1


def test_pin_process_rejects_cores_outside_the_mask(restore_affinity_and_threads):
    before = os.sched_getaffinity(0)
    with pytest.raises(ConfigError, match=r"^cpus: "):
        pin_process([min(before), max(before) + 1000])


def test_apply_cpus_empty_keeps_the_mask_and_uses_one_thread_per_core(restore_affinity_and_threads, caplog):
    current = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(current) + 3)
    with caplog.at_level(logging.INFO, logger="distserve.cpus"):
        assert apply_cpus("") == current
    assert sorted(os.sched_getaffinity(0)) == current and torch.get_num_threads() == len(current)
    assert f"torch threads {len(current)}" in caplog.text


def test_apply_cpus_pins_and_logs(restore_affinity_and_threads, caplog):
    core = min(os.sched_getaffinity(0))
    with caplog.at_level(logging.INFO, logger="distserve.cpus"):
        assert apply_cpus(str(core)) == [core]
    assert os.sched_getaffinity(0) == {core}
    assert f"pinned to cores [{core}], torch threads 1" in caplog.text


def _os_thread_name() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
        return comm.read().strip()


async def test_serving_threads_move_and_forwards_stay_on_the_workers_cores(restore_affinity_and_threads,
                                                                           monkeypatch):
    monkeypatch.setattr(cpus_module, "_compute_cpus", None)  # process-wide: restored after the test
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, f"needs two cores, has {allowed}"
    forwards = allowed[0]
    assert apply_cpus(str(forwards), format_cpu_list(allowed)) == [forwards]
    for thread_id in os.listdir("/proc/self/task"):  # every thread there is now serves, on every core
        assert sorted(os.sched_getaffinity(int(thread_id))) == allowed
    assert torch.get_num_threads() == 1  # one OpenMP thread per forward core
    compute = ComputeThread("test-forward")
    assert await compute.run(os.sched_getaffinity, 0) == {forwards}
    assert await compute.run(_os_thread_name) == "test-forward"  # visible to ps / top


def _team_affinities(name: str) -> dict[int, set[int]]:
    """Affinity of each thread of this process named `name` (a forward thread and its OpenMP team)."""
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")
            if cpus_module._thread_name(int(t)) == name}


async def test_a_forward_thread_on_several_cores_binds_its_openmp_team_one_thread_per_core(
        restore_affinity_and_threads, monkeypatch):
    monkeypatch.setattr(cpus_module, "_compute_cpus", None)
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, f"needs two cores, has {allowed}"
    apply_cpus(format_cpu_list(allowed[:2]))  # two cores, two torch threads
    compute = ComputeThread("test-team")
    forward_id = await compute.run(threading.get_native_id)
    team = await compute.run(_team_affinities, "test-team")
    assert team.pop(forward_id) == {allowed[0]}
    assert list(team.values()) == [{allowed[1]}]  # its one OpenMP thread, on the other core
    x = torch.randn(64, 64)
    assert torch.equal(await compute.run(torch.mm, x, x), torch.mm(x, x))  # the bound team computes


def test_a_forward_thread_on_one_core_starts_no_team(restore_affinity_and_threads, monkeypatch):
    monkeypatch.setattr(cpus_module, "_compute_cpus", None)
    apply_cpus(str(min(os.sched_getaffinity(0))))
    assert bind_openmp_team() == [threading.get_native_id()]


LOWER_PRIORITY_SCRIPT = """
import json, os, threading
from distserve.cpus import lower_priority, session_group_nice
def nice(tid): return os.getpriority(os.PRIO_PROCESS, tid)
before = threading.Thread(target=lambda: stop.wait()); stop = threading.Event(); before.start()
base = nice(0)
lower_priority(5)
seen = {}
after = threading.Thread(target=lambda: seen.update(after=nice(threading.get_native_id()))); after.start(); after.join()
seen.update(main=nice(0), before=nice(before.native_id), base=base)
stop.set()
seen["group"] = session_group_nice()
print(json.dumps(seen))
"""


@pytest.mark.parametrize("own_session", [True, False])
def test_lower_priority_lowers_every_thread_and_its_own_sessions_group(own_session):
    """In a process of its own session the session's group (a new one starts at nice 0) is lowered too,
    where the kernel has autogroups; a process in its caller's session leaves the caller's group alone."""
    caller_group = session_group_nice()
    done = subprocess.run([sys.executable, "-c", LOWER_PRIORITY_SCRIPT], capture_output=True, text=True, timeout=60,
                          start_new_session=own_session, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    lowered = min(seen["base"] + 5, 19)
    assert (seen["main"], seen["before"], seen["after"]) == (lowered, lowered, lowered)
    if own_session and os.path.exists(AUTOGROUP_PATH):
        assert seen["group"] == 5  # a new session's group starts at nice 0
    else:  # the caller's group (None in the root group, as in a container's init session) is left alone
        assert seen["group"] == caller_group
    assert session_group_nice() == caller_group


@pytest.mark.parametrize("content, nice", [("/autogroup-318 nice 0\n", 0), ("/autogroup-7 nice 10\n", 10),
                                           ("", None)])
def test_session_group_nice_reads_the_group_or_none_in_the_root_group(tmp_path, content, nice):
    group_file = tmp_path / "autogroup"
    group_file.write_text(content)  # the root group's file is empty
    assert session_group_nice(str(group_file)) == nice
    assert session_group_nice(str(tmp_path / "missing")) is None  # a kernel without autogroups


def test_a_session_leader_in_the_root_group_leaves_it_alone(tmp_path):
    """The root group (an empty autogroup file: init's session in a container) has no nice to lower;
    the threads are lowered all the same."""
    group_file = tmp_path / "autogroup"
    group_file.write_text("")
    script = ("import json, os, sys; from distserve import cpus; cpus.AUTOGROUP_PATH = sys.argv[1]; "
              "base = os.getpriority(os.PRIO_PROCESS, 0); problem = cpus.lower_priority(5); "
              "print(json.dumps([problem, os.getpriority(os.PRIO_PROCESS, 0) - base]))")
    done = subprocess.run([sys.executable, "-c", script, str(group_file)], capture_output=True, text=True,
                          timeout=60, start_new_session=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    problem, lowered_by = json.loads(done.stdout)
    assert problem is None and group_file.read_text() == ""
    assert lowered_by == min(5, 19 - os.getpriority(os.PRIO_PROCESS, 0))


async def test_without_serving_cores_forwards_run_where_the_worker_is_pinned(restore_affinity_and_threads,
                                                                            monkeypatch):
    monkeypatch.setattr(cpus_module, "_compute_cpus", None)
    core = max(os.sched_getaffinity(0))
    apply_cpus(str(core))
    assert await ComputeThread("test-forward").run(os.sched_getaffinity, 0) == {core}


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig, ColocatedConfig])
def test_worker_config_rejects_bad_serving_cpus_naming_the_field(cls):
    for bad in ("x", "2-1"):
        with pytest.raises(ConfigError, match=r"^serving_cpus: "):
            cls(serving_cpus=bad)


# --- worker configs ----------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("DISTSERVE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("cls, prefix", [(PrefillConfig, "DISTSERVE_PREFILL_"), (DecodeConfig, "DISTSERVE_DECODE_")])
def test_worker_cpus_setting_by_flag_and_env(clean_env, cls, prefix):
    assert parse_config(cls, [], prefix).cpus == ""
    assert parse_config(cls, ["--cpus", "0,2-3"], prefix).cpus == "0,2-3"
    clean_env.setenv(prefix + "CPUS", "1")
    assert parse_config(cls, [], prefix).cpus == "1"
    assert parse_config(cls, ["--cpus", "2-3"], prefix).cpus == "2-3"


@pytest.mark.parametrize("cls", [PrefillConfig, DecodeConfig])
def test_worker_config_rejects_bad_cpus_naming_the_field(cls):
    for bad in ("x", "2-1", "0,"):
        with pytest.raises(ConfigError, match=r"^cpus: "):
            cls(cpus=bad)


@pytest.mark.parametrize("cls, prefix", [(PrefillConfig, "DISTSERVE_PREFILL_"), (DecodeConfig, "DISTSERVE_DECODE_")])
def test_worker_help_lists_cpus(cls, prefix, capsys):
    with pytest.raises(SystemExit):
        parse_config(cls, ["--help"], prefix)
    help_text = capsys.readouterr().out
    assert "--cpus" in help_text and prefix + "CPUS" in help_text


def test_spill_makes_prefill_and_decode_workers_also_colocated(monkeypatch, tmp_path):
    spawned = {}

    def fake_spawn(self, name, argv, env=None):
        spawned[name] = argv
        return types.SimpleNamespace()

    monkeypatch.setattr(Cluster, "_spawn", fake_spawn)
    cluster = Cluster(ClusterSpec(model="m", log_dir=str(tmp_path), spill=True))
    for name, module in (("prefill-0", "services.prefill"), ("decode-0", "services.decode"),
                         ("colocated-0", "services.colocated"), ("router", "services.router")):
        cluster.start_service(name, module, "127.0.0.1:1", [], metrics_port=2)
    flagged = {name for name, argv in spawned.items() if "--also-colocated" in argv}
    assert flagged == {"prefill-0", "decode-0"}
    assert spawned["prefill-0"][spawned["prefill-0"].index("--also-colocated") + 1] == "true"


def test_up_spills_by_default_and_refuses_it_with_take_turns(tiny_model_path):
    from distserve import cli

    parser = argparse.ArgumentParser()
    cli._add_cluster_args(parser)
    assert cli._spec(parser.parse_args(["--model", tiny_model_path])).spill  # on by default
    assert not cli._spec(parser.parse_args(["--model", tiny_model_path, "--no-spill"])).spill
    with pytest.raises(ConfigError, match="^spill: "):
        cli._spec(parser.parse_args(["--model", tiny_model_path, "--take-turns"]))
    assert cli._spec(parser.parse_args(["--model", tiny_model_path, "--take-turns", "--no-spill"])).take_turns


def test_up_lends_cores_only_without_spilling_or_turns(tiny_model_path):
    from distserve import cli

    parser = argparse.ArgumentParser()
    cli._add_cluster_args(parser)
    with pytest.raises(ConfigError, match="^spill: .*--lend-cores"):
        cli._spec(parser.parse_args(["--model", tiny_model_path, "--lend-cores"]))
    with pytest.raises(ConfigError, match="^lend_cores: "):
        cli._spec(parser.parse_args(["--model", tiny_model_path, "--lend-cores", "--take-turns", "--no-spill"]))
    spec = cli._spec(parser.parse_args(["--model", tiny_model_path, "--lend-cores", "--no-spill"]))
    assert spec.lend_cores and not spec.take_turns and not spec.spill


def test_control_plane_follows_spilling_only_when_auto_put_it_on_worker_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    started = []
    monkeypatch.setattr("distserve.launcher.ControlPlacement.start", lambda self: started.append(self) or self)
    for control_cpus, spill, follows in (("auto", True, True), ("auto", False, False), ("1", True, False),
                                         ("any", True, False)):
        cluster = Cluster(ClusterSpec(model="m", log_dir=str(tmp_path), control_cpus=control_cpus, spill=spill,
                                      redis_url="redis://127.0.0.1:1/0"))
        placement = cluster._follow_load()
        assert (placement is not None) == follows, (control_cpus, spill)
    spare = Cluster(ClusterSpec(model="m", log_dir=str(tmp_path), cpus="0", num_prefill=1, num_decode=1, spill=True,
                                share_cores=True, control_cpus="auto", redis_url="redis://127.0.0.1:1/0"))
    assert spare.control_cpus == [1] and spare._follow_load() is None  # a spare core: nothing to follow
    assert [p._own for p in started] == [[1]] and started[0]._every == [0, 1]
