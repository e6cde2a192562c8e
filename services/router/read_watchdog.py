"""A bound on how long each read of one stream may wait, with one timer for the whole stream.

`asyncio.timeout` around every read made and cancelled a timer per streamed token (~7% of the router's
CPU per token in py-spy). Here a read costs two attribute stores; one timer, re-armed lazily, checks
every idle_s whether the read in progress has waited that long. Only time spent inside read() counts:
while the caller is busy with what it read (writing it to a slow client, say), the stream is not idle.
"""

from __future__ import annotations

import asyncio


class ReadWatchdog:
    def __init__(self, idle_s: float):
        self._loop = asyncio.get_running_loop()
        self._idle_s = idle_s
        self._task: asyncio.Task | None = None
        self._cancelling = 0  # the task's cancel requests when the read began (others are not ours)
        self._reading_since: float | None = None  # loop time the read in progress began; None: not reading
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False

    async def read(self, call):
        """`await call.read()`; raises TimeoutError when it has waited idle_s (the read is cancelled)."""
        self._task = asyncio.current_task()
        self._cancelling = self._task.cancelling()
        self._reading_since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._reading_since + self._idle_s, self._check)
        try:
            return await call.read()
        except asyncio.CancelledError:
            if self._expired and self._task.uncancel() <= self._cancelling:
                raise TimeoutError from None
            raise
        finally:
            self._reading_since = None

    def close(self) -> None:
        """No more reads: drops the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        since, now = self._reading_since, self._loop.time()
        if since is not None and now - since >= self._idle_s:
            self._timer = None
            self._expired = True
            self._task.cancel()
            return
        self._timer = self._loop.call_at((now if since is None else since) + self._idle_s, self._check)
