"""The LifecycleService every distserve gRPC server mounts (distserve.grpc_server): a Drain call starts
the same graceful stop as SIGTERM (deregister, accept calls for drain_s, finish in-flight ones for
grace_s, exit 0), so an operator or an orchestrator can drain one server without a signal, from
another host. Where certificates carry roles, only the admin role may drain (distserve.peer_roles)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from distserve.peer_roles import ADMIN_ROLE, peer_role
from distserve.v1 import lifecycle_pb2, lifecycle_pb2_grpc

log = logging.getLogger(__name__)


class DrainServicer(lifecycle_pb2_grpc.LifecycleServiceServicer):
    """Sets the stop event and keeps the grace the server stops with: its own, or a Drain call's shorter one."""

    def __init__(self, stop: asyncio.Event, drain_s: float, grace_s: float, admin_only: bool):
        """stop: the event that SIGTERM sets; admin_only: refuse callers whose certificate is not admin's."""
        self._stop = stop
        self._drain_s = drain_s
        self.grace_s = grace_s  # read by the server when it stops; only ever shortened
        self._admin_only = admin_only

    async def Drain(self, request, context):
        if self._admin_only and peer_role(context) != ADMIN_ROLE:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"only the {ADMIN_ROLE} role may drain a server (peer role: "
                                f"{peer_role(context) or '(none)'})")
        if request.grace_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"grace_s: must be >= 0 (0: the server's own), got {request.grace_s:g}")
        if request.grace_s > 0:
            self.grace_s = min(self.grace_s, request.grace_s)
        already = self._stop.is_set()
        log.warning("drain requested by %s (grace %g s): %s", context.peer(), self.grace_s,
                    request.reason or "no reason given")
        self._stop.set()
        return lifecycle_pb2.DrainResponse(drain_s=self._drain_s, grace_s=self.grace_s, already_draining=already)
