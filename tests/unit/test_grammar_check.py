"""services.router.grammar_check: specs compile in a child process that is killed at the deadline.

A real child (services.router.grammar_worker) on the tiny model's tokenizer; nothing is faked."""

import asyncio
import time

import pytest

from distserve.engine.structured import StructuredSpec
from distserve.model_spec import load_model_spec
from services.router.grammar_check import GrammarChecker

# Ambiguous and recursive: xgrammar works on it for seconds (minutes, with more rules) though it is 8 KiB.
SLOW_GRAMMAR = StructuredSpec("grammar", "root ::= r0\n" + "\n".join(
    f'r{i} ::= r{i + 1} r{i + 1} | "a{i}" r{i + 1} | [^q]*' for i in range(200)) + '\nr200 ::= "b"')
TIMEOUT_S = 0.5


@pytest.fixture
def with_checker(tiny_model_path):
    """Runs `body(checker)` on a fresh event loop, closing the checker (its child) on the same loop."""
    def run(body):
        async def main():
            spec = load_model_spec(tiny_model_path)
            checker = GrammarChecker(tiny_model_path, spec.vocab_size, spec.eos_token_ids, TIMEOUT_S)
            try:
                await body(checker)
            finally:
                await checker.close()
        asyncio.run(main())
    return run


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


def test_a_spec_past_the_deadline_is_refused_and_the_compiler_restarted(with_checker):
    async def run(checker):
        assert await checker.problem(StructuredSpec("regex", "a+")) == ""  # the child is up
        started = time.monotonic()
        problem = await checker.problem(SLOW_GRAMMAR)
        assert time.monotonic() - started < TIMEOUT_S + 0.5
        assert problem == f"grammar: did not compile within {TIMEOUT_S:g}s (grammar_compile_timeout_s)"
        assert checker.num_killed == 1
        assert await checker.problem(StructuredSpec("regex", "b+")) == ""  # a new child
        compiles = checker.num_compiles
        assert (await checker.problem(SLOW_GRAMMAR)).startswith("grammar: did not compile")  # cached
        assert checker.num_compiles == compiles and checker.num_killed == 1
    with_checker(run)
