"""Running a gRPC service: health, reflection, graceful SIGTERM, optional mutual TLS; one place for every
service, and the one place that opens channels to them.

Lifecycle: bind -> start -> health SERVING -> on_ready() -> wait for SIGTERM/SIGINT or a Drain call
-> health NOT_SERVING -> on_shutdown() (deregister) -> drain_s still accepting calls
-> server.stop(grace) lets in-flight calls finish -> return.

TLS: every service config inherits TlsConfig. With its three files set, servers require a client
certificate signed by the CA, and every channel (ChannelPool, `aio_channel`, `blocking_channel`)
presents the same certificate; with none set, both sides are plaintext.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable, ClassVar, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from distserve import tracing
from distserve.config import ConfigError, setting
from distserve.drain_service import DrainServicer
from distserve.peer_roles import ADMIN_ROLE
from distserve.v1 import lifecycle_pb2_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # channels: a worker's answer may carry a whole prompt's logprobs
# What one server accepts in a message. Servers inside the fleet take prompts and KV handles (KV bytes move
# over UCX, never gRPC); the router's public API sets its own, smaller cap (RouterConfig.max_request_mb).
INTERNAL_MAX_RECEIVE_BYTES = 16 * 1024 * 1024
# Keepalive: a peer that stops answering (killed host, paused process, dropped link) fails its calls
# with UNAVAILABLE within about 15 s instead of holding them until their deadlines; servers accept
# pings that often and probe idle clients the same way.
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 10_000, 5_000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted peer is dialled again within 2 s (gRPC's default backoff grows to 120 s, during which
    # calls to a peer that is back already fail fast with UNAVAILABLE).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Streams one client connection may hold open at once: well above what the gateway's one channel to the
# router carries (one stream per request in flight), far below what would exhaust a server.
MAX_CONCURRENT_STREAMS = 1024
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    # Our clients ping every KEEPALIVE_TIME_MS; one that pings more often than every half of that is
    # sent away (GOAWAY) after gRPC's default 2 strikes instead of being answered forever.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 2),
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
]


def role_cert_files(folder: str | Path, role: str) -> tuple[Path, Path]:
    """(certificate, key) of `role` in a folder laid out as distserve.dev_certs writes it: the operator's
    at the top (cert.pem, key.pem), each service role's under roles/."""
    folder = Path(folder)
    if role == ADMIN_ROLE:
        return folder / "cert.pem", folder / "key.pem"
    return folder / "roles" / f"{role}.pem", folder / "roles" / f"{role}-key.pem"


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS for gRPC, inherited by every service config: tls_cert, tls_key and tls_ca all set
    (servers require client certificates from the CA; channels present tls_cert), or none (plaintext).
    tls_dir fills the three from a folder of per-role certificates, by the config class's ROLE."""

    ROLE: ClassVar[str] = ADMIN_ROLE  # whose certificate tls_dir gives; each service's config names its own

    tls_cert: str = setting("", "PEM certificate this process presents, as server and as client",
                            env="DISTSERVE_TLS_CERT")
    tls_key: str = setting("", "PEM private key of tls_cert", env="DISTSERVE_TLS_KEY")
    tls_ca: str = setting("", "PEM CA that signed the peers' certificates", env="DISTSERVE_TLS_CA")
    tls_server_name: str = setting("", "name to expect in servers' certificates instead of the dialed host "
                                       "(e.g. one certificate for every service)", env="DISTSERVE_TLS_SERVER_NAME")
    tls_check_roles: bool = setting(False, "with TLS, refuse calls whose client certificate does not name a role "
                                           "allowed to call this service (its subject's OU; see "
                                           "distserve.peer_roles); `up --tls-dir` turns it on",
                                    env="DISTSERVE_TLS_CHECK_ROLES")
    tls_dir: str = setting("", "folder of per-role certificates as `distserve up --tls-dir` lays it out (ca.pem, "
                               "roles/<role>.pem and roles/<role>-key.pem): present this service's role's "
                               "certificate and check callers' roles (tls_cert, tls_key, tls_ca win where set)",
                           env="DISTSERVE_TLS_DIR")

    def __post_init__(self) -> None:
        """Resolves tls_dir into this role's files; a subclass's __post_init__ calls this first."""
        if not self.tls_dir:
            return
        cert, key = role_cert_files(self.tls_dir, self.ROLE)
        for name, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", Path(self.tls_dir) / "ca.pem")):
            if not getattr(self, name):
                object.__setattr__(self, name, str(path))
        object.__setattr__(self, "tls_check_roles", True)

    @property
    def is_tls(self) -> bool:
        return bool(self.tls_cert or self.tls_key or self.tls_ca)

    def tls_env(self) -> dict[str, str]:
        """The environment that gives a child process these settings (how the launcher passes them on):
        the resolved files, never tls_dir, which would give the child its own role's."""
        return {f.metadata["env"]: str(int(value) if isinstance(value, bool) else value)
                for f in dataclasses.fields(TlsConfig) if f.name != "tls_dir" and (value := getattr(self, f.name))}

    def tls_pem(self) -> tuple[bytes, bytes, bytes]:
        """(cert, key, ca) file contents; ConfigError naming the field that is missing or unreadable."""
        contents = []
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if not path:
                raise ConfigError(f"{name}: required when any of tls_cert, tls_key, tls_ca is set")
            try:
                contents.append(open(path, "rb").read())
            except OSError as exc:
                raise ConfigError(f"{name}: cannot read {path}: {exc.strerror}") from exc
        return contents[0], contents[1], contents[2]


PLAINTEXT = TlsConfig()


@dataclasses.dataclass(frozen=True)
class GrpcServerConfig(TlsConfig):
    """What every gRPC server's config holds beside TLS: its limits."""

    max_concurrent_streams: int = setting(MAX_CONCURRENT_STREAMS, "concurrent calls one client connection may "
                                          "have open (HTTP/2 streams); the gateway's and router's multiplexed "
                                          "sessions carry many calls in one", env="DISTSERVE_MAX_CONCURRENT_STREAMS")


def bind(server: grpc.aio.Server, address: str, tls: TlsConfig) -> int:
    """Adds the listening port (TLS requiring client certificates, or plaintext); returns it, 0 on failure."""
    if not tls.is_tls:
        return server.add_insecure_port(address)
    cert, key, ca = tls.tls_pem()
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
    return server.add_secure_port(address, credentials)


def _channel_args(tls: TlsConfig) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    if not tls.is_tls:
        return None, CHANNEL_OPTIONS
    cert, key, ca = tls.tls_pem()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    name = [("grpc.ssl_target_name_override", tls.tls_server_name)] if tls.tls_server_name else []
    return credentials, CHANNEL_OPTIONS + name


def aio_channel(address: str, tls: TlsConfig, interceptors: list | None = None) -> grpc.aio.Channel:
    """An asyncio channel to a distserve service, with this process's client certificate under TLS."""
    credentials, options = _channel_args(tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def blocking_channel(address: str, tls: TlsConfig) -> grpc.Channel:
    """A synchronous channel (launcher health checks, CLI, tests), like `aio_channel`."""
    credentials, options = _channel_args(tls)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


@dataclasses.dataclass
class Service:
    """One servicer to mount: `add(servicer, server)` is the generated add_*_to_server."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str  # e.g. "distserve.v1.RouterService", for health and reflection
    on_stop: Callable[[], None] | None = None  # when the server stops taking calls (e.g. end long-lived streams)


async def run_grpc_server(
    address: str,
    services: list[Service],
    on_ready: Callable[[int], Awaitable[None]] | None = None,
    on_shutdown: Callable[[], Awaitable[None]] | None = None,
    grace_s: float = 30.0,
    stop_event: asyncio.Event | None = None,
    drain_s: float = 0.0,
    tls: TlsConfig = PLAINTEXT,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int = INTERNAL_MAX_RECEIVE_BYTES,
    peer_roles: frozenset[str] | None = None,
    max_concurrent_streams: int = MAX_CONCURRENT_STREAMS,
) -> None:
    """Serves until SIGTERM/SIGINT, a LifecycleService Drain call (distserve.drain_service), or stop_event.
    on_ready gets the bound port.

    After on_shutdown (deregistration) the server keeps accepting calls for drain_s, so requests
    routed to it just before it left the registry still land; then it stops taking new calls and
    lets in-flight ones finish for up to grace_s (or a Drain call's shorter one). A message over
    max_receive_bytes fails its call with RESOURCE_EXHAUSTED; a client connection may have
    max_concurrent_streams calls open. With tls.tls_check_roles, only clients whose certificates name one
    of peer_roles may call (distserve.peer_roles); None: any certificate from the CA.
    """
    if tls.is_tls and tls.tls_check_roles and peer_roles is not None:
        from distserve.peer_roles import PeerRoleInterceptor
        interceptors = [PeerRoleInterceptor(peer_roles), *interceptors]
    if max_concurrent_streams < 1:
        raise ConfigError(f"max_concurrent_streams: must be >= 1, got {max_concurrent_streams}")
    per_server = {"grpc.max_receive_message_length": max_receive_bytes,
                  "grpc.max_concurrent_streams": max_concurrent_streams}
    options = [(key, value) for key, value in SERVER_OPTIONS if key not in per_server] + list(per_server.items())
    server = grpc.aio.server(options=options, interceptors=list(interceptors))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    stop = stop_event or asyncio.Event()
    drainer = DrainServicer(stop, drain_s, grace_s, admin_only=tls.is_tls and tls.tls_check_roles)
    services = [*services, Service(lifecycle_pb2_grpc.add_LifecycleServiceServicer_to_server, drainer,
                                   "distserve.v1.LifecycleService")]
    for service in services:
        service.add(service.servicer, server)
    names = [s.full_name for s in services]
    reflection.enable_server_reflection(
        names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = bind(server, address, tls)
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    await server.start()
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on port %d (%s)", ",".join(names), port, "mutual TLS" if tls.is_tls else "plaintext")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_ready:
        await on_ready(port)
    await stop.wait()
    log.info("shutting down")
    await health_servicer.enter_graceful_shutdown()
    if on_shutdown:
        await on_shutdown()
    if drain_s > 0:
        await asyncio.sleep(drain_s)
    for service in services:
        if service.on_stop is not None:
            service.on_stop()
    await server.stop(drainer.grace_s)  # a Drain call may have shortened it
    log.info("stopped")


class ChannelPool:
    """One channel per peer address, reused across calls; close() at shutdown."""

    def __init__(self, tls: TlsConfig = PLAINTEXT) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = aio_channel(address, self._tls, tracing.client_interceptors())
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
