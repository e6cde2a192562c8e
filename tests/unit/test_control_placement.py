"""ControlPlacement: the control plane floats over every core while the registry shows every core busy."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import redis

from distserve.control_placement import ControlPlacement, every_core_busy
from distserve.cpus import move_threads
from distserve.registry import WorkerRecord, WorkerRegistry, lists_now
from distserve.spill_policy import SpillPolicy

POLICY = SpillPolicy(prefill_tokens=1024, decode_running=32)


async def publish(redis_client, *records: WorkerRecord) -> None:
    registry = WorkerRegistry(redis_client, lease_s=30)
    for record in records:
        await registry.publish(record)


def pair(queued: int = 0, running: int = 0) -> list[WorkerRecord]:
    return [WorkerRecord("p", "prefill", "p:1", load={"outstanding_tokens": queued}),
            WorkerRecord("d", "decode", "d:1", load={"num_running": running})]


def spill(worker_id: str, outstanding: int = 0, running: int = 0) -> WorkerRecord:
    return WorkerRecord(worker_id, "colocated", f"{worker_id}:1",
                        load={"outstanding_tokens": outstanding, "num_running": running, "spill_only": 1})


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(redis_url) as sync_client:
        yield sync_client


async def test_lists_now_reads_what_the_async_registry_lists_and_the_spilling_mark(redis_client, client):
    roles = ("prefill", "decode", "colocated")
    assert lists_now(client, roles) == (False, {role: [] for role in roles})
    await publish(redis_client, *pair(queued=7), spill("p0", running=2))
    registry = WorkerRegistry(redis_client, 30)
    await registry.mark_spilling(5.0)
    spilling, workers = lists_now(client, roles)
    assert spilling is True
    assert workers == {role: await registry.list(role) for role in roles}
    assert [w.worker_id for w in workers["colocated"]] == ["p0"] and workers["prefill"]


async def test_an_idle_pair_or_no_pair_keeps_the_control_plane_home(redis_client, client):
    assert not every_core_busy(client, POLICY)  # no workers at all
    await publish(redis_client, *pair(queued=1023, running=31))
    assert not every_core_busy(client, POLICY)


@pytest.mark.parametrize("queued, running", [(1024, 0), (0, 32)])
async def test_a_saturated_pair_makes_every_core_busy(redis_client, client, queued, running):
    await publish(redis_client, *pair(queued, running))
    assert every_core_busy(client, POLICY)


async def test_a_routers_spilling_mark_makes_every_core_busy_until_it_lapses(redis_client, client):
    await publish(redis_client, *pair())
    await WorkerRegistry(redis_client, 30).mark_spilling(0.2)
    assert every_core_busy(client, POLICY)
    await asyncio.sleep(0.3)
    assert not every_core_busy(client, POLICY)


async def test_spilled_work_under_way_makes_every_core_busy(redis_client, client):
    await publish(redis_client, *pair())
    # the decode worker's colocated half reports its whole batch (pair sequences too): not spilled work
    await publish(redis_client, spill("d", running=5), spill("p"))
    assert not every_core_busy(client, POLICY)
    await publish(redis_client, spill("p", running=1))  # the prefill worker decodes a whole request
    assert every_core_busy(client, POLICY)
    await publish(redis_client, spill("p"), spill("d", outstanding=256))  # the decode worker prefills one
    assert every_core_busy(client, POLICY)


@pytest.fixture
def child():
    """A child process with a second thread."""
    code = "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        while len(os.listdir(f"/proc/{process.pid}/task")) < 2:
            pass
        yield process.pid
    finally:
        process.kill()
        process.wait()


def thread_cores(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


def test_move_threads_moves_every_thread_and_skips_the_gone(child):
    every = sorted(os.sched_getaffinity(0))
    move_threads([child, 2**22 + 1], [every[-1]])  # the second pid does not exist
    assert thread_cores(child) == [{every[-1]}] * 2
    move_threads([child], every)
    assert thread_cores(child) == [set(every)] * 2


async def test_placement_floats_while_busy_and_returns_after(redis_client, redis_url, child):
    every = sorted(os.sched_getaffinity(0))
    own = [every[-1]]
    placement = ControlPlacement(redis_url, lambda: [child], own, every, POLICY,  # checked by hand: not started
                                 records_interval_s=0.0)  # every check reads the workers' reports
    await publish(redis_client, *pair(queued=5000))
    placement.check()
    assert placement.floating and thread_cores(child) == [set(every)] * 2
    await publish(redis_client, *pair())
    placement.check()
    assert not placement.floating and thread_cores(child) == [set(own)] * 2
    placement.stop()


async def test_the_spilling_mark_is_read_every_check_and_the_workers_reports_once_per_records_interval(
        redis_client, redis_url, child):
    """A router's spilling mark moves the control plane at the next check; a saturated report only once
    the records are read again (they change once per heartbeat)."""
    every = sorted(os.sched_getaffinity(0))
    now = [100.0]
    placement = ControlPlacement(redis_url, lambda: [child], [every[-1]], every, POLICY, records_interval_s=1.0,
                                 clock=lambda: now[0])
    await publish(redis_client, *pair())
    placement.check()  # reads everything: idle
    assert not placement.floating
    await publish(redis_client, *pair(queued=5000))
    now[0] += 0.5
    placement.check()  # the reports are not read again yet
    assert not placement.floating
    await WorkerRegistry(redis_client, 30).mark_spilling(5.0)
    placement.check()  # the mark is read at every check
    assert placement.floating
    await redis_client.delete("distserve:spilling")
    now[0] += 0.6
    placement.check()  # a second on: the saturated reports keep it floating
    assert placement.floating
    await publish(redis_client, *pair())
    now[0] += 1.0
    placement.check()
    assert not placement.floating
    placement.stop()
