"""Supervisor: restart with doubling backoff, reset once stable, give up on a crash loop; exit causes."""

from __future__ import annotations

import dataclasses
import logging
import signal

from distserve.supervisor import RestartPolicy, Supervisor, describe_exit

POLICY = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=2.0, stable_after_s=30, max_restarts=3, window_s=60)


@dataclasses.dataclass
class FakeChild:
    """A child whose exit code the test sets; respawning makes it run again."""

    name: str = "router"
    state: str = "running"
    restarts: int = 0
    code: int | None = None
    spawned: int = 0

    def exit_code(self) -> int | None:
        return self.code

    def log_tail(self, lines: int = 40) -> str:
        return "last words"


def supervisor_of(child: FakeChild) -> Supervisor:
    def respawn(c: FakeChild) -> None:
        c.code, c.spawned = None, c.spawned + 1

    return Supervisor(lambda: [child], respawn, POLICY)


def crash_and_restart(supervisor: Supervisor, child: FakeChild, at: float) -> float:
    """Kills the child at `at`; returns how long the supervisor waited before respawning it."""
    child.code = -signal.SIGKILL
    supervisor.check(child, at)
    assert child.state == "restarting"
    spawned = child.spawned
    t = at
    while child.spawned == spawned:
        t += 0.25
        supervisor.check(child, t)
        assert t - at < 60, "never restarted"
    assert child.state == "running"
    return t - at


def test_backoff_doubles_up_to_the_maximum_and_resets_once_stable():
    child = FakeChild()
    supervisor = supervisor_of(child)
    supervisor.check(child, 0.0)
    waits = [crash_and_restart(supervisor, child, 100.0 * i) for i in range(1, 4)]
    assert waits == [0.5, 1.0, 2.0] and child.restarts == 3
    supervisor.check(child, 400.0)
    supervisor.check(child, 431.0)  # up 31 s: stable again
    assert crash_and_restart(supervisor, child, 432.0) == 0.5


def test_a_crash_loop_is_given_up_and_logged_loudly(caplog):
    child = FakeChild()
    supervisor = supervisor_of(child)
    supervisor.check(child, 0.0)
    at = 1.0
    for _ in range(POLICY.max_restarts):
        at += crash_and_restart(supervisor, child, at) + 0.25
    child.code = 1
    with caplog.at_level(logging.CRITICAL, logger="distserve.supervisor"):
        for t in (at, at + 10, at + 100):
            supervisor.check(child, t)
    assert child.state == "failed" and child.restarts == POLICY.max_restarts
    assert child.spawned == POLICY.max_restarts  # no further restart, even much later
    assert "crash loop" in caplog.text and "exited with code 1" in caplog.text and "last words" in caplog.text


def test_restarts_spread_beyond_the_window_never_give_up():
    child = FakeChild()
    supervisor = supervisor_of(child)
    for i in range(POLICY.max_restarts * 2):
        crash_and_restart(supervisor, child, 100.0 * (i + 1))  # one restart per 100 s > window_s
    assert child.state == "running" and child.restarts == POLICY.max_restarts * 2


def test_drains_restart_at_once_and_never_count_toward_a_crash_loop():
    """A clean exit (exit 0: a drain, as `distserve restart` makes) is started again after no backoff,
    however often, and leaves a crash's doubling where it was."""
    child = FakeChild()
    supervisor = supervisor_of(child)
    supervisor.check(child, 0.0)
    for i in range(POLICY.max_restarts * 2):
        child.code = 0
        supervisor.check(child, 1.0 + i)
        supervisor.check(child, 1.0 + i)
        assert child.state == "running" and child.spawned == i + 1
    assert crash_and_restart(supervisor, child, 50.0) == 0.5  # the first crash waits the initial backoff


def test_exit_causes_name_the_signal_or_code():
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with code 3"


def test_stop_ends_supervision_without_restarting():
    child = FakeChild(code=-9)
    supervisor = supervisor_of(child).start()
    supervisor.stop()
    supervisor.stop()  # idempotent
    supervisor.check(child, 0.0)
    supervisor.check(child, 10.0)
    assert child.spawned == 0


@dataclasses.dataclass
class ProbedChild(FakeChild):
    """A child whose health answer the test sets; kill() makes it exit as SIGKILL does."""

    answering: bool | None = True
    killed: int = 0

    def kill(self) -> None:
        self.killed += 1
        self.code = -signal.SIGKILL


def probed_supervisor(child: ProbedChild, hang_after_s: float = 10.0) -> Supervisor:
    def respawn(c: ProbedChild) -> None:
        c.code, c.spawned = None, c.spawned + 1

    return Supervisor(lambda: [child], respawn, dataclasses.replace(POLICY, hang_after_s=hang_after_s),
                      probe=lambda c: c.answering)


def test_a_child_that_stops_answering_for_the_hang_window_is_killed_then_restarted():
    child = ProbedChild()
    supervisor = probed_supervisor(child)
    supervisor.check(child, 0.0)
    supervisor.probe(child, 1.0)  # answered once: it is up
    child.answering = False
    for t in (2.0, 6.0, 10.9):
        supervisor.probe(child, t)
    assert child.killed == 0, "not yet hung for 10 s"
    supervisor.probe(child, 11.0)
    assert child.killed == 1
    supervisor.check(child, 11.1)  # its exit is seen as any other
    assert child.state == "restarting"
    supervisor.check(child, 11.7)
    assert child.spawned == 1 and child.state == "running"
    for t in (12.0, 30.0, 60.0):  # restarted, still starting (never answered since): left alone
        supervisor.probe(child, t)
    assert child.killed == 1


def test_a_slow_starter_a_child_without_a_probe_and_a_disabled_window_are_left_alone():
    starting = ProbedChild(answering=False)
    supervisor = probed_supervisor(starting)
    supervisor.check(starting, 0.0)
    for t in range(1, 120, 5):
        supervisor.probe(starting, float(t))
    assert starting.killed == 0, "it never answered: starting, not hung"
    unprobed = ProbedChild(answering=None)
    supervisor = probed_supervisor(unprobed)
    supervisor.check(unprobed, 0.0)
    for t in range(1, 120, 5):
        supervisor.probe(unprobed, float(t))
    assert unprobed.killed == 0
    disabled = probed_supervisor(ProbedChild(), hang_after_s=0).start()
    assert not disabled._prober.is_alive()
    disabled.stop()
