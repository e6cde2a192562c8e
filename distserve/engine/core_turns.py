"""Turns at shared cores: workers on the same cores compute one at a time, prefill first.

Two workers that run at once on the same (or SMT-sibling) cores each slow the other 1.5-3x
(README "What runs beside a prefill costs it"), and an OpenMP loop split statically across
threads waits for its slowest thread. Giving each its own core avoids that, but then a prefill
uses half the machine while decode idles between steps, and the other way round.

With turns (`distserve up --take-turns`), prefill workers get all the node's cores and decode workers
keep their share, and a forward (a prefill batch, a decode step) runs only while its worker holds the
node's compute lock, so a prefill has every core to itself. A prefill waits for at most the
decode step in progress; a decode step waits while any prefill waits or runs. Both locks are `flock`s
on files in one directory that every worker of the node is given (`--core-turns`):

    prefill turn: lock(want, shared);    lock(compute); run; unlock(compute); unlock(want)
    decode turn:  lock(want, exclusive); lock(compute); unlock(want); run; unlock(compute)

Prefills share `want` while they wait and run, so a decode step cannot take it until none is left;
Linux grants a shared flock while an exclusive one waits, so prefills keep that priority. flock
locks die with their process, so a killed worker never leaves the others waiting.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

WANT_FILE = "want.lock"
COMPUTE_FILE = "compute.lock"


class CoreTurns:
    """One worker's side of a node's compute turns (see the module docstring).

    `priority` is True for prefill workers. Use `turn()` from the one thread that runs forwards:
    flock excludes other open files, not other threads of the same one.
    """

    def __init__(self, directory: str, priority: bool):
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.directory = str(path)
        self.priority = priority
        self._want = os.open(path / WANT_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._compute = os.open(path / COMPUTE_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Blocks until this worker may compute; the cores are its until the block exits."""
        fcntl.flock(self._want, fcntl.LOCK_SH if self.priority else fcntl.LOCK_EX)
        try:
            fcntl.flock(self._compute, fcntl.LOCK_EX)
        except BaseException:
            fcntl.flock(self._want, fcntl.LOCK_UN)
            raise
        if not self.priority:
            fcntl.flock(self._want, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._compute, fcntl.LOCK_UN)
            if self.priority:
                fcntl.flock(self._want, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._want)
        os.close(self._compute)


class NoTurns:
    """A worker with cores of its own: every turn is granted at once."""

    directory = ""

    @staticmethod
    def turn() -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def core_turns(directory: str, priority: bool) -> CoreTurns | NoTurns:
    """The worker's turns: shared ones in `directory` (a --core-turns value), none when it is empty."""
    return CoreTurns(directory, priority) if directory else NoTurns()
