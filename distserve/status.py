"""`distserve status`: every child of a running `distserve up`, with its health and load.

Where the children are comes from the launcher's state file (distserve.cluster_state):
name, pid, address, restarts, supervision state. Health is asked of each child
(gRPC health for services, PING for Redis, GET /health for the gateway). Load
comes from the worker registry in Redis: outstanding prefill tokens, running and
waiting requests, free KV blocks, held KV bytes, as each worker last published.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import urllib.error
import urllib.request

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve import redis_client
from distserve.grpc_server import TlsConfig, aio_channel
from distserve.record_signing import KEY_FILE_ENV, RecordSigner, load_key
from distserve.redact import redact_url
from distserve.registry import WorkerRecord, WorkerRegistry

ROLES = ("prefill", "decode", "colocated")
LOAD_FIELDS = {"outstanding_tokens": "outstanding", "num_running": "running", "num_waiting": "waiting",
               "free_blocks": "free blocks", "held_bytes": "held KV bytes"}
TIMEOUT_S = 2.0


@dataclasses.dataclass
class ChildStatus:
    name: str
    pid: int
    where: str  # address or URL
    restarts: int
    state: str  # supervision: running | restarting | failed | exited
    health: str  # SERVING, NOT_SERVING, UNREACHABLE, ...
    load: dict[str, float]


def tls_from_state(state: dict) -> TlsConfig:
    """The TLS settings the launcher gave its children (file paths), so health checks pass mTLS."""
    by_env = {f.metadata["env"]: f.name for f in dataclasses.fields(TlsConfig)}
    return TlsConfig(**{by_env[env]: value for env, value in state.get("tls", {}).items() if env in by_env})


def signer_from_state(state: dict) -> RecordSigner:
    """Checks registry records with the launcher's key: the file the state names, else this environment's
    (DISTSERVE_REGISTRY_KEY); with neither, every record is shown."""
    path = state.get("registry_key_file")
    return RecordSigner(load_key({KEY_FILE_ENV: path} if path else os.environ))


async def _grpc_health(address: str, tls: TlsConfig) -> str:
    async with aio_channel(address, tls) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return f"UNREACHABLE ({exc.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _http_health(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as reply:
            return "SERVING" if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"NOT_SERVING (HTTP {exc.code})"
    except OSError as exc:
        return f"UNREACHABLE ({exc.__class__.__name__})"


async def _registry_view(client: aioredis.Redis, signer: RecordSigner) -> tuple[str, dict[str, WorkerRecord]]:
    """Redis's health and the registered workers (whose records `signer` accepts) by address."""
    try:
        await client.ping()
        registry = WorkerRegistry(client, lease_s=0, signer=signer)
        records = [r for role in ROLES for r in await registry.list(role)]
    except (aioredis.RedisError, OSError) as exc:
        return f"UNREACHABLE ({exc.__class__.__name__})", {}
    return "SERVING", {r.address: r for r in records}


async def collect(state: dict, redis_url: str) -> list[ChildStatus]:
    """The status of every child in a launcher's state (see distserve.cluster_state.describe)."""
    client = redis_client.connect(redis_url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
    try:
        redis_health, records = await _registry_view(client, signer_from_state(state))
    finally:
        await client.aclose()
    rows = []
    for child in state["children"]:
        name, address = child["name"], child["address"]
        if name == "redis":
            where, health = redact_url(redis_url), redis_health
        elif name == "gateway":
            where = state["gateway_url"]
            health = await asyncio.to_thread(_http_health, where)
        else:
            where, health = address, await _grpc_health(address, tls_from_state(state))
        record = records.get(address)
        load = {label: record.load[key] for key, label in LOAD_FIELDS.items() if record and key in record.load}
        if address and name.startswith(ROLES) and record is None:
            health += ", not registered"
        rows.append(ChildStatus(name, child["pid"], where, child["restarts"], child["state"], health, load))
    return rows


def render(rows: list[ChildStatus]) -> str:
    header = f"{'SERVICE':<12} {'PID':>7} {'ADDRESS':<28} {'RESTARTS':>8} {'STATE':<10} HEALTH / LOAD"
    lines = [header]
    for row in rows:
        load = ", ".join(f"{label} {value:g}" for label, value in row.load.items())
        lines.append(f"{row.name:<12} {row.pid:>7} {row.where:<28} {row.restarts:>8} {row.state:<10} "
                     f"{row.health}{'  | ' + load if load else ''}")
    return "\n".join(lines)
