"""Fault injection: kill -9 one child at a time, at planned request counts, and wait for recovery.

The schedule spreads `num_faults` kills evenly over the run; their kinds come in
shuffled rounds of all six (decode worker, prefill worker, kvbroker, Redis,
router, gateway), so each kind is hit once the run has six faults. At most one
fault is outstanding: a fault lasts from its kill until `wait_recovered`, and
the requests past the next fault's trigger wait for that (the ones in between
run during the outage, as clients would). Every fault records the requests in
flight at its kill and the router's retry count (its migrations) across it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import urllib.request

from distserve.launcher import Cluster, StartError
from tests.cluster_helpers import wait_recovered

KINDS = ("decode", "prefill", "kvbroker", "redis", "router", "gateway")
RECOVERY_TIMEOUT_S = 120.0


@dataclasses.dataclass
class Fault:
    """One kill and what it touched."""

    trigger: int  # killed once this many requests have started
    kind: str
    process: str = ""
    killed_at: float = 0.0  # time.monotonic()
    killed_at_wall: str = ""  # local time, to find the kill in the children's logs
    recovery_s: float | None = None  # None: not recovered (yet)
    in_flight: list[int] = dataclasses.field(default_factory=list)  # request indices in flight at the kill
    during: list[int] = dataclasses.field(default_factory=list)  # requests started before recovery
    router_retries: float | None = None  # the router's retries (migrations) across the fault, if it lived
    error: str = ""  # why recovery failed


def schedule(rng: random.Random, num_requests: int, num_faults: int) -> list[Fault]:
    """num_faults faults, triggers evenly spaced inside the run, kinds in shuffled rounds of KINDS."""
    kinds: list[str] = []
    while len(kinds) < num_faults:
        kinds += rng.sample(KINDS, len(KINDS))
    step = num_requests / (num_faults + 1)
    return [Fault(round(step * (i + 1)), kind) for i, kind in enumerate(kinds[:num_faults])]


class Tracker:
    """Which requests are in flight, and which fault each one lived through."""

    def __init__(self):
        self.num_started = 0
        self.in_flight: set[int] = set()
        self.current: Fault | None = None  # the outstanding fault
        self.faults_of: dict[int, list[Fault]] = {}  # request index -> faults during its life

    def start(self, index: int) -> None:
        self.num_started += 1
        self.in_flight.add(index)
        self.faults_of[index] = []
        if self.current:
            self.current.during.append(index)
            self.faults_of[index].append(self.current)

    def finish(self, index: int) -> None:
        self.in_flight.discard(index)

    def begin_fault(self, fault: Fault) -> None:
        self.current = fault
        fault.in_flight = sorted(self.in_flight)
        for index in fault.in_flight:
            self.faults_of[index].append(fault)


class Injector:
    """Runs the schedule against the cluster (`run`); request senders call `ready_for` before each request."""

    def __init__(self, cluster: Cluster, rng: random.Random, faults: list[Fault], tracker: Tracker,
                 num_prefill: int, num_decode: int):
        self._cluster, self._rng, self.faults, self._tracker = cluster, rng, faults, tracker
        self._counts = (num_prefill, num_decode)
        self._recovered = [asyncio.Event() for _ in faults]

    async def ready_for(self, index: int) -> None:
        """Waits until every fault whose successor triggers at or before `index` has recovered."""
        for k, fault in enumerate(self.faults[:-1]):
            if self.faults[k + 1].trigger <= index:
                await self._recovered[k].wait()

    async def run(self) -> None:
        try:
            for k, fault in enumerate(self.faults):
                while self._tracker.num_started < fault.trigger:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(self._rng.uniform(0, 0.5))  # land anywhere in a request's life
                try:
                    await self._inject(fault)
                finally:
                    self._tracker.current = None
                    self._recovered[k].set()
                if fault.error:  # the system did not come back: further faults would say nothing new
                    return
        finally:
            for event in self._recovered:  # no sender waits for a fault that will not come
                event.set()

    async def _inject(self, fault: Fault) -> None:
        names = [name for name in self._cluster.processes if name.split("-")[0] == fault.kind]
        fault.process = self._rng.choice(names)
        retries_before = await asyncio.to_thread(router_retries, self._cluster)
        self._tracker.begin_fault(fault)
        fault.killed_at = time.monotonic()
        fault.killed_at_wall = time.strftime("%H:%M:%S")
        await asyncio.to_thread(self._cluster.kill, fault.process)
        try:
            await asyncio.to_thread(wait_recovered, self._cluster, *self._counts, RECOVERY_TIMEOUT_S)
        except (AssertionError, StartError) as exc:  # not back within the timeout
            fault.error = str(exc)
            return
        fault.recovery_s = time.monotonic() - fault.killed_at
        retries_after = await asyncio.to_thread(router_retries, self._cluster)
        if fault.kind != "router" and None not in (retries_before, retries_after):  # a new router counts from 0
            fault.router_retries = retries_after - retries_before


def router_retries(cluster: Cluster) -> float | None:
    """The router's distserve:request_retries_total over all stages; None (and a warning) if unreadable."""
    try:
        with urllib.request.urlopen(cluster.processes["router"].metrics_url, timeout=10) as reply:
            text = reply.read().decode()
    except OSError as exc:
        print(f"warning: router metrics unreadable: {exc}", flush=True)
        return None
    prefix = "distserve:request_retries_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))
