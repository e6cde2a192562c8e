"""`distserve drain` and `distserve restart`: drain servers of a running `distserve up` by name, or
restart its workers one at a time.

A drained server deregisters, finishes (or, past its grace, migrates) what it serves and exits 0
(distserve.drain_service); the launcher's supervisor then starts it again on the same address. A
rolling restart drains each worker in turn and waits until its new process is healthy and registered
before the next, so the fleet never loses more than one worker's capacity and no request fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from distserve import bearer_key, cluster_state
from distserve.grpc_server import aio_channel
from distserve.status import ROLES, collect, tls_from_state
from distserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc

TIMEOUT_S = 10.0
POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Drained:
    name: str
    drain_s: float
    grace_s: float
    already_draining: bool


async def drain(state: dict, name: str, reason: str, grace_s: float = 0.0) -> Drained:
    """Asks the child `name` of a launcher's state to drain, within grace_s if that is shorter than its own
    (0: its own); raises KeyError for an unknown name (or one with no gRPC address: Redis, the gateway) and
    grpc.aio.AioRpcError when it refuses."""
    address = {c["name"]: c["address"] for c in state["children"] if c["address"]}[name]
    async with aio_channel(address, tls_from_state(state)) as channel:
        reply = await lifecycle_pb2_grpc.LifecycleServiceStub(channel).Drain(
            lifecycle_pb2.DrainRequest(reason=reason, grace_s=grace_s), timeout=TIMEOUT_S,
            metadata=bearer_key.call_metadata(bearer_key.key_from_env()))
    return Drained(name, reply.drain_s, reply.grace_s, reply.already_draining)


def worker_names(state: dict, roles: tuple[str, ...] = ROLES) -> list[str]:
    """The workers of a launcher's state, in its order (prefill, decode, colocated as started)."""
    return [c["name"] for c in state["children"] if c["name"].startswith(roles) and c["address"]]


async def wait_back(state_file: Path, name: str, old_pid: int, timeout_s: float) -> None:
    """Waits until `name` runs as a new process that answers health and is registered again."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = cluster_state.read(state_file)
        child = next(c for c in state["children"] if c["name"] == name)
        if child["state"] in ("exited", "failed"):
            raise RuntimeError(f"{name} exited and is not being started again (state {child['state']}: is "
                               f"`distserve up` running with --no-supervise?)")
        if child["pid"] != old_pid and child["state"] == "running":
            rows = {row.name: row for row in await collect(state, cluster_state.redis_url(state))}
            if rows[name].health == "SERVING":
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not come back (new process, healthy, registered) within {timeout_s:g} s")
        await asyncio.sleep(POLL_S)


async def rolling_restart(state_file: Path, roles: tuple[str, ...], reason: str, report) -> list[str]:
    """Drains each worker of `roles` in turn and waits for it to be back; returns the names restarted.
    report(text) is told of each step."""
    state = cluster_state.read(state_file)
    names = worker_names(state, roles)
    for name in names:
        old_pid = next(c["pid"] for c in cluster_state.read(state_file)["children"] if c["name"] == name)
        drained = await drain(state, name, reason)
        report(f"{name}: draining (accepting calls {drained.drain_s:g} s, finishing them up to {drained.grace_s:g} s)")
        await wait_back(state_file, name, old_pid, drained.drain_s + drained.grace_s + 300)
        report(f"{name}: back, serving and registered")
    return names
