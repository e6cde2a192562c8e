"""The one thread on which an engine runs its forwards.

`asyncio.to_thread` hands each call to whichever thread of the loop's default pool is free, and
OpenMP (torch's CPU thread pool) keeps one team of threads per calling thread: forwards spread over
several threads start several teams, and the idle workers of one spin on the cores the next
forward's team needs. One thread per engine keeps one team, and the step's thread-local state warm.
The thread carries its name into the OS (ps, top, /proc/<pid>/task/*/comm) and keeps to the worker's
cores when the worker serves from other ones (distserve.cpus.pin_compute_thread); on several cores it
binds its OpenMP team one thread per core (distserve.cpus.bind_openmp_team).
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from distserve.cpus import bind_openmp_team, pin_compute_thread

T = TypeVar("T")
_PR_SET_NAME = 15


def _name_os_thread(name: str) -> None:
    """Names the calling thread for the OS (at most 15 bytes); Python's thread names stay in Python."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded (libc's): no library lookup
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is cosmetic
        pass


def _start_compute_thread(name: str) -> None:
    _name_os_thread(name)
    pin_compute_thread()
    bind_openmp_team()


class ComputeThread:
    """Runs blocking calls one at a time on a single thread of its own."""

    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name,
                                            initializer=_start_compute_thread, initargs=(name,))

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Like asyncio.to_thread (the caller's context variables go along), on this thread. Cancelling
        the await does not stop a call already running: it finishes, and its result is dropped."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)
