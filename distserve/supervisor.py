"""Supervision: a thread that restarts any child of a Cluster that dies, or hangs.

A child's life: running -> (it exits) restarting -> (backoff elapsed) running
again, on the same argv, environment, ports and log file; or, when it has
restarted `max_restarts` times within `window_s`, failed: it stays down and the
launcher logs that loudly. The wait before a restart doubles from
`initial_backoff_s` to `max_backoff_s`, and returns to `initial_backoff_s` once
the child has stayed up `stable_after_s`. Each exit is logged with its cause
(exit code or signal) and the last lines of the child's log.

A hung child (paused, deadlocked: alive but not answering) is found by a second thread that probes
every child's health every PROBE_S: one that answered once since it (re)started and then fails every
probe for `hang_after_s` is killed (SIGKILL), and so restarted as above. A child still starting (never
answered yet) is left alone, however slow its start.

Restarted children keep their addresses, so clients reconnect to them, and
workers re-register in Redis with their next heartbeat (also after a Redis
restart, which empties the registry).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import signal
import threading
import time
from typing import Callable, Protocol

log = logging.getLogger(__name__)

POLL_S = 0.1
PROBE_S = 1.0


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    """Wait before the first restart of a child that has been stable."""
    max_backoff_s: float = 10.0
    """The wait doubles after each restart up to this."""
    stable_after_s: float = 30.0
    """A child up this long is stable again: its next restart waits initial_backoff_s."""
    max_restarts: int = 5
    """This many restarts within window_s is a crash loop: the child is left down (failed)."""
    window_s: float = 60.0
    hang_after_s: float = 30.0
    """A child that answered its health probe since it started and then fails every probe this long is
    hung: it is killed, then restarted. 0: never."""


class Supervised(Protocol):
    """What the supervisor needs of a child (distserve.launcher.ManagedProcess)."""

    name: str
    state: str  # "running" | "restarting" | "failed"
    restarts: int

    def exit_code(self) -> int | None: ...

    def log_tail(self, lines: int = 40) -> str: ...

    def kill(self) -> None: ...


@dataclasses.dataclass
class _Track:
    """Supervision bookkeeping of one child."""

    backoff_s: float
    started_at: float
    restart_at: float | None = None  # when a pending restart is due
    recent: collections.deque = dataclasses.field(default_factory=collections.deque)  # restart times
    answered_at: float | None = None  # the last health probe it answered since it (re)started
    drained: bool = False  # the pending restart follows a clean exit (a drain), not a failure


def describe_exit(code: int) -> str:
    """'exited with code 3' or 'killed by SIGKILL' (Popen's returncode is -signal for a signal)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class Supervisor:
    """Polls `children()` every POLL_S and restarts the dead through `respawn(child)`; call stop() first
    when shutting down, so nothing is restarted while being stopped. `on_change` runs after each state change."""

    def __init__(self, children: Callable[[], list[Supervised]], respawn: Callable[[Supervised], None],
                 policy: RestartPolicy = RestartPolicy(), on_change: Callable[[], None] = lambda: None,
                 probe: Callable[[Supervised], bool | None] | None = None):
        """probe(child): whether it answers its health check now (None: it has none); with a probe and
        policy.hang_after_s, hung children are killed (module docstring)."""
        self._children = children
        self._respawn = respawn
        self.policy = policy
        self._on_change = on_change
        self._probe = probe
        self._tracks: dict[str, _Track] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._every, args=(POLL_S, self.check, "restarting"),
                                        name="distserve-supervisor", daemon=True)
        self._prober = threading.Thread(target=self._every, args=(PROBE_S, self.probe, "probing"),
                                        name="distserve-health-probe", daemon=True)

    def start(self) -> "Supervisor":
        self._thread.start()
        if self._probe is not None and self.policy.hang_after_s > 0:
            self._prober.start()
        return self

    def stop(self) -> None:
        """Stops supervising; returns once no restart or kill is in progress. Idempotent."""
        self._stop.set()
        for thread in (self._thread, self._prober):
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()

    def _every(self, interval_s: float, step: Callable[[Supervised, float], None], doing: str) -> None:
        """step(child, now) for every child each interval_s, until stop()."""
        while not self._stop.wait(interval_s):
            for child in self._children():
                try:
                    step(child, time.monotonic())
                except Exception:  # one child's failed restart, probe or kill must not end the others'
                    log.exception("supervisor: %s %s failed", doing, child.name)

    def probe(self, child: Supervised, now: float) -> None:
        """One hang check of one running child at time `now` (monotonic seconds)."""
        track = self._tracks.get(child.name)
        if track is None or child.state != "running" or child.exit_code() is not None:
            return
        started_at = track.started_at
        answered = self._probe(child)
        if answered is None or track.started_at != started_at:  # no probe, or restarted meanwhile
            return
        if answered:
            track.answered_at = now
        elif track.answered_at is not None and now - track.answered_at >= self.policy.hang_after_s:
            log.error("%s has not answered its health check for %.0f s: hung; killing it to restart it. "
                      "Last log lines:\n%s", child.name, now - track.answered_at, child.log_tail(10))
            track.answered_at = None
            child.kill()

    def check(self, child: Supervised, now: float) -> None:
        """One supervision step for one child at time `now` (monotonic seconds)."""
        policy = self.policy
        track = self._tracks.setdefault(child.name, _Track(policy.initial_backoff_s, now))
        code = child.exit_code()
        if code is None:
            if now - track.started_at >= policy.stable_after_s:
                track.backoff_s = policy.initial_backoff_s
            return
        if child.state == "failed":
            return
        if track.restart_at is None:
            self._on_exit(child, track, code, now)
        elif now >= track.restart_at:
            self._restart(child, track, now)

    def _on_exit(self, child: Supervised, track: _Track, code: int, now: float) -> None:
        if code == 0:  # a clean exit is a drain (SIGTERM or a Drain call): start it again now, uncounted
            if self._stop.is_set():
                return
            child.state = "restarting"
            track.restart_at, track.backoff_s, track.drained = now, self.policy.initial_backoff_s, True
            log.warning("%s exited 0 (drained); starting it again", child.name)
            self._on_change()
            return
        while track.recent and now - track.recent[0] > self.policy.window_s:
            track.recent.popleft()
        if len(track.recent) >= self.policy.max_restarts:
            child.state = "failed"
            log.critical("%s %s and restarted %d times within %.0f s: crash loop, giving up; it stays down. "
                         "Last log lines:\n%s", child.name, describe_exit(code), len(track.recent),
                         self.policy.window_s, child.log_tail(20))
        else:
            child.state = "restarting"
            track.restart_at = now + track.backoff_s
            log.error("%s %s; restarting in %.1f s. Last log lines:\n%s", child.name, describe_exit(code),
                      track.backoff_s, child.log_tail(10))
        self._on_change()

    def _restart(self, child: Supervised, track: _Track, now: float) -> None:
        if self._stop.is_set():
            return
        self._respawn(child)
        child.restarts += 1
        child.state = "running"
        if not track.drained:  # only failures count toward a crash loop and lengthen the wait
            track.recent.append(now)
            track.backoff_s = min(track.backoff_s * 2, self.policy.max_backoff_s)
        track.drained = False
        track.restart_at = None
        track.started_at = now
        track.answered_at = None
        log.warning("%s restarted (restart %d)", child.name, child.restarts)
        self._on_change()
