"""Which services may call which: each certificate names its holder's role, and servers check it.

With per-role certificates (`distserve up --tls-dir` makes them: distserve.dev_certs), a certificate's
subject carries its role as OU (`O=distserve, OU=router, CN=distserve`). A server started with
tls_check_roles refuses (PERMISSION_DENIED) a call whose client certificate names a role it does not
serve, or none. Health checks and reflection stay open to any certificate from the CA, for probes.

Who calls whom over gRPC (KV bytes move over UCX, under the per-request kv_secret, not through these):
- workers (prefill, decode, colocated): the router, and the operator (admin);
- kvbroker: the router and the workers, which register, claim and release KV handles; the operator;
- router: any certificate from the CA (the gateway, clients); it has its API key besides.
"""

from __future__ import annotations

import inspect

import grpc

from distserve.bearer_key import OPEN_METHOD_PREFIXES

ADMIN_ROLE = "admin"  # the operator: the launcher, `distserve status` and `generate`, tests
ROLES = ("router", "gateway", "kvbroker", "prefill", "decode", "colocated")
WORKER_CALLERS = frozenset({"router", ADMIN_ROLE})
BROKER_CALLERS = frozenset({"router", "prefill", "decode", "colocated", ADMIN_ROLE})


def peer_role(context) -> str:
    """The role (OU) in the calling client's certificate subject; "" when it names none or there is none."""
    for subject in context.auth_context().get("x509_subject", ()):
        for part in subject.decode(errors="replace").split(","):
            name, _, value = part.strip().partition("=")
            if name == "OU":
                return value
    return ""


class PeerRoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection from a client whose certificate's role is not allowed."""

    def __init__(self, allowed: frozenset[str]):
        if not allowed:
            raise ValueError("no allowed role would refuse every caller")
        self.allowed = allowed

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        return _checked(handler, self)

    def refusal(self, context) -> str:
        """Why this call's peer may not call; empty when it may."""
        role = peer_role(context)
        if role in self.allowed:
            return ""
        return (f"peer role: a client certificate of role {role or '(none)'} may not call this service "
                f"(allowed: {', '.join(sorted(self.allowed))})")


def _checked(handler: grpc.RpcMethodHandler, guard: PeerRoleInterceptor) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that checks the peer's role before running it."""
    serializers = dict(request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                       ("unary_stream", grpc.unary_stream_rpc_method_handler),
                       ("stream_unary", grpc.stream_unary_rpc_method_handler),
                       ("stream_stream", grpc.stream_stream_rpc_method_handler)):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return make(_guarded(behavior, guard), **serializers)
    return handler


def _guarded(behavior, guard: PeerRoleInterceptor):
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request, context):
            if problem := guard.refusal(context):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
            async for message in behavior(request, context):
                yield message
        return streaming

    async def answering(request, context):
        if problem := guard.refusal(context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        return await behavior(request, context)
    return answering
