"""CoreTurns: workers sharing cores compute one at a time, in turn, and a dead holder frees the cores.
Turns are taken in real processes (spawned), as the workers take them."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing
import os
import threading
import time

import pytest

from distserve.engine.core_turns import GATE_FILE, CoreTurns, NoTurns, core_turns

WAIT_S = 20.0  # bound on every wait, so a broken lock fails the test instead of hanging it


def hold_turn(directory: str, again: bool, name: str, entered, release, order) -> None:
    """A worker: waits for its turn, records (time entered, `name`) in `order`, holds the turn until
    `release` is set; with `again`, asks for a second turn at once and records `name`-again in it.
    (CLOCK_MONOTONIC is one clock for all processes; a queue's arrival order need not be put order.)"""
    turns = CoreTurns(directory)
    with turns.turn():
        order.put((time.monotonic(), name))
        entered.set()
        release.wait(WAIT_S)
    if again:
        with turns.turn():
            order.put((time.monotonic(), f"{name}-again"))


@pytest.fixture
def spawn():
    context = multiprocessing.get_context("spawn")
    started = []

    def start(directory: str, again: bool, name: str, order):
        entered, release = context.Event(), context.Event()
        process = context.Process(target=hold_turn, args=(str(directory), again, name, entered, release, order))
        process.start()
        started.append(process)
        return process, entered, release

    yield start, context
    for process in started:
        process.kill()
        process.join(WAIT_S)


def gate_is_held(directory) -> bool:
    """Whether some worker holds the gate, i.e. waits for the compute lock (a turn in progress holds only that)."""
    fd = os.open(os.path.join(directory, GATE_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing the file releases the probe's own lock, if it took it
    return False


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def turn_taker(directory):
    """A thread of this process asking for a turn; yields an event set once it has had one. On exit the
    thread is joined (out of its turn) before the turn files close."""
    got_turn = threading.Event()
    mine = CoreTurns(str(directory))

    def take() -> None:
        with mine.turn():
            got_turn.set()

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    try:
        yield got_turn
    finally:
        taker.join(WAIT_S)
        mine.close()


def test_a_turn_waits_until_the_holder_ends_its_turn(tmp_path, spawn):
    start, context = spawn
    order = context.Queue()
    _, entered, release = start(tmp_path, False, "decode", order)
    assert entered.wait(WAIT_S)

    with turn_taker(tmp_path) as got_turn:
        assert not got_turn.wait(0.5)  # the other process computes: no turn for us meanwhile
        release.set()
        assert got_turn.wait(WAIT_S)


def test_turns_alternate_the_worker_computing_now_goes_after_the_one_waiting(tmp_path, spawn):
    """A prefill forward running and a decode step waiting: the prefill's next forward waits for that step."""
    start, context = spawn
    order = context.Queue()
    _, prefill_entered, prefill_release = start(tmp_path, True, "prefill", order)
    assert prefill_entered.wait(WAIT_S)
    _, step_entered, step_release = start(tmp_path, False, "decode-step", order)
    wait_until(lambda: gate_is_held(tmp_path), "the decode step to wait at the compute lock, holding the gate")
    assert not step_entered.is_set()

    prefill_release.set()  # the prefill ends its turn and asks for the next one at once
    assert step_entered.wait(WAIT_S)
    step_release.set()
    entries = sorted(order.get(timeout=WAIT_S) for _ in range(3))
    assert [name for _, name in entries] == ["prefill", "decode-step", "prefill-again"]


def test_a_killed_holder_frees_the_cores(tmp_path, spawn):
    start, context = spawn
    order = context.Queue()  # kept referenced until the child has it
    holder, entered, _ = start(tmp_path, False, "prefill", order)
    assert entered.wait(WAIT_S)
    holder.kill()
    holder.join(WAIT_S)

    with turn_taker(tmp_path) as got_turn:
        assert got_turn.wait(WAIT_S)


def test_a_turn_is_released_when_the_work_in_it_raises(tmp_path):
    prefill, decode = CoreTurns(str(tmp_path)), CoreTurns(str(tmp_path))
    with pytest.raises(RuntimeError):
        with prefill.turn():
            raise RuntimeError("forward failed")
    entered = []
    with decode.turn():  # would block forever if the prefill's locks were still held
        entered.append(True)
    assert entered == [True]
    prefill.close()
    decode.close()


def test_no_directory_means_no_turns(tmp_path):
    assert isinstance(core_turns(""), NoTurns)
    with core_turns("").turn():
        pass
    shared = core_turns(str(tmp_path / "turns"))
    assert isinstance(shared, CoreTurns) and (tmp_path / "turns").is_dir()
    shared.close()
