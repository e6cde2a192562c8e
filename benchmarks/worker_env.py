"""Benchmarks measure the engine as a worker runs it."""

from __future__ import annotations

import os
import sys


def reexec_like_a_worker(module: str) -> None:
    """Re-executes `python -m module` with the malloc settings workers get from the launcher (glibc reads
    them only at process start); returns at once when they are already set."""
    from distserve.launcher import WORKER_MALLOC_ENV

    if any(key not in os.environ for key in WORKER_MALLOC_ENV):
        os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], {**os.environ, **WORKER_MALLOC_ENV})
