"""The launcher's /metrics counts the supervisor's restarts of each child and shows its state."""

from __future__ import annotations

import signal
import urllib.request

from distserve.metrics import LauncherMetrics
from distserve.ports import free_port
from tests.dashboard_queries import exposed_names
from tests.unit.test_supervisor import FakeChild, crash_and_restart, supervisor_of


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_restarts_and_state_follow_the_supervisor():
    router, decode = FakeChild("router"), FakeChild("decode-0")
    metrics, port = LauncherMetrics(lambda: [router, decode]), free_port()
    metrics.serve(port)
    try:
        supervisor = supervisor_of(router)
        supervisor.check(router, 0.0)
        crash_and_restart(supervisor, router, 100.0)
        decode.code = -signal.SIGKILL
        supervisor_of(decode).check(decode, 0.0)  # restart pending
        text = _scrape(port)
    finally:
        metrics.stop()
        metrics.stop()  # idempotent
    assert 'distserve:service_restarts_total{service="router"} 1.0' in text
    assert 'distserve:service_restarts_total{service="decode-0"} 0.0' in text
    assert 'distserve:service_state{service="router",state="running"} 1.0' in text
    assert 'distserve:service_state{service="decode-0",state="restarting"} 1.0' in text


def test_metrics_are_defined_before_there_are_children():
    metrics, port = LauncherMetrics(lambda: []), free_port()
    metrics.serve(port)
    try:
        names = exposed_names(_scrape(port))
    finally:
        metrics.stop()
    assert {"distserve:service_restarts_total", "distserve:service_state"} <= names
