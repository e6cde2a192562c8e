"""ComputeThread: every call runs on one thread of its own, with the caller's context variables."""

from __future__ import annotations

import asyncio
import contextvars
import threading

from distserve.engine.compute_thread import ComputeThread

request_id = contextvars.ContextVar("request_id", default="")


async def test_every_call_runs_on_the_same_thread_not_the_loops():
    compute = ComputeThread("test-forward")
    idents = await asyncio.gather(*(compute.run(threading.get_ident) for _ in range(8)))
    assert len(set(idents)) == 1
    assert idents[0] != threading.get_ident()


async def test_calls_run_one_at_a_time_in_order():
    compute, running, seen = ComputeThread("test-forward"), [], []

    def work(i: int) -> int:
        running.append(i)
        seen.append(len(running))
        running.remove(i)
        return i * i

    assert await asyncio.gather(*(compute.run(work, i) for i in range(6))) == [0, 1, 4, 9, 16, 25]
    assert seen == [1] * 6


async def test_the_callers_context_goes_along():
    request_id.set("req-7")
    assert await ComputeThread("test-forward").run(request_id.get) == "req-7"
