"""The event loop a service runs on: uvloop where it is installed, else asyncio's own.

uvloop (libuv) runs the router's and gateway's per-token work (stream reads and writes, callbacks,
timers) in less CPU than the default loop. DISTSERVE_EVENT_LOOP=asyncio chooses the default loop, to
compare or to rule uvloop out.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
CHOICES = ("uvloop", "asyncio")


def chosen() -> str:
    """The loop new_loop() makes: DISTSERVE_EVENT_LOOP's choice, uvloop by default where it imports."""
    choice = os.environ.get("DISTSERVE_EVENT_LOOP", "uvloop").strip().lower() or "uvloop"
    if choice not in CHOICES:
        raise ValueError(f"DISTSERVE_EVENT_LOOP must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
    return choice


def new_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the chosen kind (not set as the current one)."""
    if chosen() == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on a loop of the chosen kind."""
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(main)
