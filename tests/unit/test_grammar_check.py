"""services.router.grammar_check: specs compile in forks of a child process, each killed at the deadline;
a child that gives no verdict within the wait is restarted and its caller gets a retryable CompilerBusy;
compiles share a CPU budget.

A real child (services.router.grammar_worker) on the tiny model's tokenizer; nothing is faked."""

import asyncio
import time
from pathlib import Path

import pytest

from distserve.engine.structured import StructuredSpec
from distserve.model_spec import load_model_spec
from services.router.grammar_check import CompilerBusy, CpuBudget, GrammarChecker

# Ambiguous and recursive: xgrammar works on it for seconds (minutes, with more rules) though it is 8 KiB.
SLOW_GRAMMAR = StructuredSpec("grammar", "root ::= r0\n" + "\n".join(
    f'r{i} ::= r{i + 1} r{i + 1} | "a{i}" r{i + 1} | [^q]*' for i in range(200)) + '\nr200 ::= "b"')
TIMEOUT_S = 0.5


@pytest.fixture
def with_checker(tiny_model_path):
    """Runs `body(checker)` on a fresh event loop, closing the checker (its child) on the same loop."""
    def run(body, **options):
        async def main():
            spec = load_model_spec(tiny_model_path)
            checker = GrammarChecker(tiny_model_path, spec.vocab_size, spec.eos_token_ids, TIMEOUT_S, **options)
            try:
                await body(checker)
            finally:
                await checker.close()
        asyncio.run(main())
    return run


def live_processes_in_group(group: int) -> list[int]:
    """The pids of the process group that are running (zombies, killed and not yet reaped, are not)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            live.append(int(stat.parent.name))
    return live


def test_verdicts_name_the_kind_are_cached_and_stay_in_step_when_a_caller_leaves(with_checker):
    async def run(checker):
        assert await checker.problem(StructuredSpec("regex", "[a-z]+")) == ""
        assert (await checker.problem(StructuredSpec("regex", "(("))).startswith("regex: ")
        assert await checker.problem(StructuredSpec("choice", ("yes", "no"))) == ""
        compiles = checker.num_compiles
        assert (await checker.problem(StructuredSpec("regex", "(("))).startswith("regex: ")
        assert await checker.problem(StructuredSpec("regex", "[a-z]+")) == ""
        assert checker.num_compiles == compiles
        # a caller cancelled mid-compile: the compile finishes, and the next spec gets its own answer
        waiting = asyncio.ensure_future(checker.problem(StructuredSpec("regex", "[a-z]{1,2000}")))
        await asyncio.sleep(0.01)
        waiting.cancel()
        assert (await checker.problem(StructuredSpec("regex", "(b"))).startswith("regex: ")
        assert await checker.problem(StructuredSpec("regex", "[a-z]{1,2000}")) == ""
        assert checker.num_compiles == compiles + 2
    with_checker(run)


def test_a_spec_past_the_deadline_is_refused_and_the_compiler_goes_on(with_checker):
    async def run(checker):
        assert await checker.problem(StructuredSpec("regex", "a+")) == ""  # the child is up
        child = checker._child.pid
        started = time.monotonic()
        problem = await checker.problem(SLOW_GRAMMAR)
        assert time.monotonic() - started < TIMEOUT_S + 0.5
        assert problem == f"grammar: did not compile within {TIMEOUT_S:g}s (grammar_compile_timeout_s)"
        assert checker.num_over_limit == 1
        assert await checker.problem(StructuredSpec("regex", "b+")) == ""
        assert checker._child.pid == child  # only the compile's fork was killed, not the loaded child
        compiles = checker.num_compiles
        assert (await checker.problem(SLOW_GRAMMAR)).startswith("grammar: did not compile")  # cached
        assert checker.num_compiles == compiles and checker.num_over_limit == 1
    with_checker(run)


def test_no_verdict_within_the_wait_is_a_retryable_error_not_cached_and_the_child_restarted(with_checker):
    """A wait shorter than the deadline stands for a child that stopped answering: the caller hears that
    it may retry, the spec is not judged, and the compile's fork dies with the child."""
    async def run(checker):
        assert await checker.problem(StructuredSpec("regex", "a+")) == ""
        child = checker._child.pid
        with pytest.raises(CompilerBusy, match="retry later"):
            await checker.problem(SLOW_GRAMMAR)
        assert not live_processes_in_group(child)  # the child and its compile fork are gone
        assert await checker.problem(StructuredSpec("regex", "b+")) == ""  # a new child
        assert checker._child.pid != child and checker.num_over_limit == 0
        with pytest.raises(CompilerBusy):
            await checker.problem(SLOW_GRAMMAR)  # compiled again: a busy verdict is not cached
    with_checker(run, wait_s=0.2)


def test_the_cpu_budget_lets_a_burst_of_cheap_compiles_through_and_spaces_slow_ones_to_its_share():
    now = [0.0]
    budget = CpuBudget(capacity_s=2.0, share=0.1, clock=lambda: now[0])
    for _ in range(10):  # ten 50 ms compiles at once: within the 2 s bucket, no wait
        assert budget.wait_s() == 0
        budget.charge(0.05)
    budget.charge(2.0)  # a slow one, killed at its 2 s limit: the level is now -0.5 s
    assert budget.wait_s() == pytest.approx(5.0)  # refilled at 0.1 s per s
    now[0] += 5.0
    assert budget.wait_s() == pytest.approx(0.0)
    now[0] += 1000.0
    assert budget.level() == 2.0  # never above the capacity
