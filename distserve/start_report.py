"""What `distserve up` says while it starts its children, and the CPU kernel build it announces.

distserve.launcher.Cluster reports through a StartReport; `distserve up` prints its lines, tests pass no
callback and see nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

KERNELS = "CPU kernels"  # the kernel build's name in the start report


class StartReport:
    """What Cluster.start says as it goes, one line at a time to `emit` (None: nowhere): the CPU kernel
    build, each child as it starts, and each as it serves or fails, with the seconds since it was started.

        building CPU kernels for this machine (once; 30 s to a few minutes) ...
        built    CPU kernels                            31.2 s
        starting redis ...
        ready    redis        127.0.0.1:6390             0.1 s
        starting decode-0 ...
        failed   decode-0     exited with code 1         2.9 s
    """

    def __init__(self, emit: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self._emit = emit or (lambda line: None)
        self._clock = clock
        self._started: dict[str, float] = {}

    def starting(self, name: str) -> None:
        self._started[name] = self._clock()
        self._emit(f"starting {name} ...")

    def ready(self, name: str, address: str) -> None:
        self._emit(self._row("ready", name, address))

    def failed(self, name: str, how: str) -> None:
        self._emit(self._row("failed", name, how))

    def building_kernels(self) -> None:
        self._started[KERNELS] = self._clock()
        self._emit(f"building {KERNELS} for this machine (once; 30 s to a few minutes) ...")

    def kernels_built(self) -> None:
        self._emit(self._row("built", KERNELS, ""))

    def kernels_failed(self, log_path: Path) -> None:
        self._emit(self._row("failed", KERNELS, "not built"))
        self._emit(f"         the workers use the slower torch path; the build's log: {log_path}")

    def _row(self, verb: str, name: str, detail: str) -> str:
        seconds = self._clock() - self._started.get(name, self._clock())
        return f"{verb:<8} {name:<12} {detail:<24} {seconds:5.1f} s"


def build_cpu_kernels(env: dict[str, str], log_path: Path) -> bool:
    """Builds the CPU kernels in a child with the workers' environment, its output to log_path; whether
    they were built (False: no compiler, say; the workers then use the torch path)."""
    with open(log_path, "wb") as log_file:
        return subprocess.run([sys.executable, "-m", "distserve.engine.cpu_kernels"], stdout=log_file,
                              stderr=subprocess.STDOUT, env=env, check=False).returncode == 0
