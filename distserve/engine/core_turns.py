"""Turns at shared cores: workers on the same cores compute one at a time, in turn.

Two workers that run at once on the same (or SMT-sibling) cores each slow the other 1.5-3x
(benchmarks/results/HISTORY.md, "What runs beside the prefill costs it"), and an OpenMP loop
split statically across threads waits for its slowest thread. Giving each its own core avoids that,
but then a prefill uses half the machine while decode idles between steps, and the other way round.

With turns (`distserve up --take-turns`), prefill workers get all the node's cores and decode workers
keep their share, and a forward (a prefill batch, a decode step) runs only while its worker holds the
node's compute lock, so a prefill has every core to itself. Turns alternate: a worker waiting for the
lock holds a gate on the way in, so the worker computing now cannot take the next turn before it.
With one prefill and one decode worker, a prefill waits for at most the decode step in progress, and
a decode step for at most one prefill forward. Both locks are `flock`s on files in one directory that
every worker of the node is given (`--core-turns`):

    turn: lock(gate); lock(compute); unlock(gate); run; unlock(compute)

flock locks die with their process, so a killed worker never leaves the others waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

GATE_FILE = "gate.lock"
COMPUTE_FILE = "compute.lock"


class CoreTurns:
    """One worker's side of a node's compute turns (see the module docstring).

    Use `turn()` from the one thread that runs forwards: flock excludes other open files, not other
    threads of the same one.
    """

    def __init__(self, directory: str):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._gate = os.open(path / GATE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._compute = os.open(path / COMPUTE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Blocks until this worker may compute; the cores are its until the block exits."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._compute, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._compute, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._gate)
        os.close(self._compute)


class NoTurns:
    """A worker with cores of its own: every turn is granted at once."""

    @staticmethod
    def turn() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def core_turns(directory: str) -> CoreTurns | NoTurns:
    """The worker's turns: shared ones in `directory` (a --core-turns value), none when it is empty."""
    return CoreTurns(directory) if directory else NoTurns()
