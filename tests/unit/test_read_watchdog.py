"""services.router.read_watchdog: one timer bounds each read of a stream; time between reads is not idle."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.router.read_watchdog import ReadWatchdog


class Stream:
    """read() returns the next item of `delays` after that many seconds (None: never)."""

    def __init__(self, delays):
        self._delays = list(delays)

    async def read(self):
        delay = self._delays.pop(0)
        if delay is None:
            await asyncio.Event().wait()
        await asyncio.sleep(delay)
        return delay


async def test_a_read_waiting_past_idle_s_raises_timeout_and_leaves_the_task_uncancelled():
    watchdog = ReadWatchdog(0.2)
    stream = Stream([0.0, None])
    assert await watchdog.read(stream) == 0.0
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await watchdog.read(stream)
    assert 0.2 <= time.monotonic() - started < 0.6
    assert asyncio.current_task().cancelling() == 0
    watchdog.close()


async def test_reads_spaced_under_idle_s_never_time_out_however_long_the_stream():
    watchdog = ReadWatchdog(0.15)
    stream = Stream([0.1] * 6)  # 0.6 s in all, no read waits 0.15 s
    assert [await watchdog.read(stream) for _ in range(6)] == [0.1] * 6
    watchdog.close()


async def test_time_between_reads_is_not_idle():
    watchdog = ReadWatchdog(0.15)
    stream = Stream([0.0, 0.0])
    await watchdog.read(stream)
    await asyncio.sleep(0.4)  # the caller is busy: the timer fires and re-arms without cancelling
    assert await watchdog.read(stream) == 0.0
    watchdog.close()


async def test_a_cancel_from_elsewhere_stays_a_cancel():
    watchdog = ReadWatchdog(5.0)
    reader = asyncio.ensure_future(watchdog.read(Stream([None])))
    await asyncio.sleep(0.05)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    watchdog.close()


async def test_an_expired_read_inside_a_cancelled_task_stays_a_cancel():
    """Both at once (the client left as the stream went idle): the caller's cancel wins."""
    watchdog = ReadWatchdog(0.1)

    async def read_then_get_cancelled():
        task = asyncio.current_task()
        asyncio.get_running_loop().call_later(0.1, task.cancel)
        return await watchdog.read(Stream([None]))

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(read_then_get_cancelled())
    watchdog.close()
