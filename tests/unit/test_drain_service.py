"""distserve.drain_service: Drain sets the server's stop event; with role checks, only the admin may."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from distserve.drain_service import DrainServicer
from distserve.v1 import lifecycle_pb2


class Aborted(Exception):
    pass


class Context:
    """The servicer-facing part of a grpc.aio context, with a certificate naming `role` (or none)."""

    def __init__(self, role: str | None):
        self._role = role
        self.code = None

    def auth_context(self) -> dict:
        return {} if self._role is None else {"x509_subject": [f"O=distserve,OU={self._role},CN=distserve".encode()]}

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1234"

    async def abort(self, code, details):
        self.code = code
        raise Aborted(details)


async def test_drain_sets_the_stop_event_and_says_whether_a_drain_had_begun():
    stop = asyncio.Event()
    servicer = DrainServicer(stop, drain_s=2.0, grace_s=60.0, admin_only=False)
    reply = await servicer.Drain(lifecycle_pb2.DrainRequest(reason="maintenance"), Context(None))
    assert stop.is_set() and (reply.drain_s, reply.grace_s, reply.already_draining) == (2.0, 60.0, False)
    assert (await servicer.Drain(lifecycle_pb2.DrainRequest(), Context(None))).already_draining


@pytest.mark.parametrize("role", ["router", "decode", None])
async def test_with_role_checks_only_the_admin_may_drain(role):
    stop = asyncio.Event()
    servicer = DrainServicer(stop, drain_s=2.0, grace_s=60.0, admin_only=True)
    context = Context(role)
    with pytest.raises(Aborted, match="admin"):
        await servicer.Drain(lifecycle_pb2.DrainRequest(), context)
    assert context.code == grpc.StatusCode.PERMISSION_DENIED and not stop.is_set()
    await servicer.Drain(lifecycle_pb2.DrainRequest(), Context("admin"))
    assert stop.is_set()


async def test_a_drain_call_may_shorten_the_grace_but_never_lengthen_it():
    servicer = DrainServicer(asyncio.Event(), drain_s=0.0, grace_s=60.0, admin_only=False)
    assert (await servicer.Drain(lifecycle_pb2.DrainRequest(grace_s=90), Context(None))).grace_s == 60.0
    assert (await servicer.Drain(lifecycle_pb2.DrainRequest(grace_s=5), Context(None))).grace_s == 5.0
    assert (await servicer.Drain(lifecycle_pb2.DrainRequest(grace_s=0), Context(None))).grace_s == 5.0
    assert servicer.grace_s == 5.0  # what the server stops with


async def test_a_negative_grace_is_refused_naming_the_field():
    stop = asyncio.Event()
    servicer = DrainServicer(stop, drain_s=0.0, grace_s=60.0, admin_only=False)
    context = Context(None)
    with pytest.raises(Aborted, match="grace_s"):
        await servicer.Drain(lifecycle_pb2.DrainRequest(grace_s=-1), context)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and not stop.is_set() and servicer.grace_s == 60.0
