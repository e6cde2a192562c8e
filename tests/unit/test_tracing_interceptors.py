"""Client interceptors exist only while tracing is on: grpc.aio's interception costs a task per call and
an async generator per stream read on every token's hops."""

from __future__ import annotations

import grpc

from distserve import tracing


def test_no_interceptors_while_tracing_is_off(monkeypatch):
    monkeypatch.setattr(tracing, "_installed", False)
    assert tracing.client_interceptors() == []


def test_tracing_on_intercepts_unary_and_streaming_calls(monkeypatch):
    monkeypatch.setattr(tracing, "_installed", True)
    kinds = [type(i).__mro__[1] for i in tracing.client_interceptors()]
    assert kinds == [grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor]
