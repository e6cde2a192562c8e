"""CoreTurns: workers sharing cores compute one at a time, a waiting prefill goes before decode, a dead
holder frees the cores. Turns are taken in real processes (spawned), as the workers take them."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from distserve.engine.core_turns import CoreTurns, NoTurns, core_turns

WAIT_S = 20.0  # bound on every wait, so a broken lock fails the test instead of hanging it


def hold_turn(directory: str, priority: bool, name: str, entered, release, order) -> None:
    """A worker: waits for its turn, records `name` in `order`, holds the turn until `release` is set."""
    turns = CoreTurns(directory, priority)
    with turns.turn():
        order.put(name)
        entered.set()
        release.wait(WAIT_S)


@pytest.fixture
def spawn():
    context = multiprocessing.get_context("spawn")
    started = []

    def start(directory: str, priority: bool, name: str, order):
        entered, release = context.Event(), context.Event()
        process = context.Process(target=hold_turn, args=(str(directory), priority, name, entered, release, order))
        process.start()
        started.append(process)
        return process, entered, release

    yield start, context
    for process in started:
        process.kill()
        process.join(WAIT_S)


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_turn_waits_until_the_holder_ends_its_turn(tmp_path, spawn):
    start, context = spawn
    order = context.Queue()
    _, entered, release = start(tmp_path, False, "decode", order)
    assert entered.wait(WAIT_S)

    got_turn = threading.Event()
    mine = CoreTurns(str(tmp_path), priority=True)

    def take() -> None:
        with mine.turn():
            got_turn.set()

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    assert not got_turn.wait(0.5)  # the other process computes: no turn for us meanwhile
    release.set()
    assert got_turn.wait(WAIT_S)
    taker.join(WAIT_S)
    mine.close()


def test_prefills_go_before_a_decode_step_that_asked_earlier(tmp_path, spawn):
    """A prefill running, a decode step waiting, a second prefill arriving: the second prefill goes next."""
    start, context = spawn
    order = context.Queue()
    _, first_entered, first_release = start(tmp_path, True, "prefill-1", order)
    assert first_entered.wait(WAIT_S)
    _, step_entered, step_release = start(tmp_path, False, "decode-step", order)
    time.sleep(0.5)  # the decode step now waits
    _, second_entered, second_release = start(tmp_path, True, "prefill-2", order)
    time.sleep(0.5)  # and so does the second prefill
    assert not step_entered.is_set() and not second_entered.is_set()

    first_release.set()
    assert second_entered.wait(WAIT_S)
    assert not step_entered.wait(0.5)  # no decode step while a prefill runs
    second_release.set()
    assert step_entered.wait(WAIT_S)
    step_release.set()
    assert [order.get(timeout=WAIT_S) for _ in range(3)] == ["prefill-1", "prefill-2", "decode-step"]


def test_a_prefill_waits_for_the_decode_step_in_progress_only(tmp_path, spawn):
    start, context = spawn
    order = context.Queue()
    _, step_entered, step_release = start(tmp_path, False, "decode-step-1", order)
    assert step_entered.wait(WAIT_S)
    _, prefill_entered, prefill_release = start(tmp_path, True, "prefill", order)
    time.sleep(0.5)
    _, next_entered, next_release = start(tmp_path, False, "decode-step-2", order)
    time.sleep(0.5)
    step_release.set()
    assert prefill_entered.wait(WAIT_S)
    prefill_release.set()
    assert next_entered.wait(WAIT_S)
    next_release.set()
    assert [order.get(timeout=WAIT_S) for _ in range(3)] == ["decode-step-1", "prefill", "decode-step-2"]


def test_a_killed_holder_frees_the_cores(tmp_path, spawn):
    start, context = spawn
    order = context.Queue()  # kept referenced until the child has it
    holder, entered, _ = start(tmp_path, True, "prefill", order)
    assert entered.wait(WAIT_S)
    holder.kill()
    holder.join(WAIT_S)

    got_turn = threading.Event()
    mine = CoreTurns(str(tmp_path), priority=False)

    def take() -> None:
        with mine.turn():
            got_turn.set()

    threading.Thread(target=take, daemon=True).start()
    assert got_turn.wait(WAIT_S)
    mine.close()


def test_a_turn_is_released_when_the_work_in_it_raises(tmp_path):
    prefill, decode = CoreTurns(str(tmp_path), True), CoreTurns(str(tmp_path), False)
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
    assert isinstance(core_turns("", priority=True), NoTurns)
    with core_turns("", priority=False).turn():
        pass
    shared = core_turns(str(tmp_path / "turns"), priority=True)
    assert isinstance(shared, CoreTurns) and (tmp_path / "turns").is_dir()
    shared.close()
