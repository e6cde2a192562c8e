"""The router's check of structured-output specs: compiled in a child process under a deadline.

xgrammar compiles in native code that never yields, and some specs under the size cap never finish (an
ambiguous recursive grammar, say). Compiled in the router's threads, each such request would hold a
thread and a core for good. Here a child process (services.router.grammar_worker) compiles one spec at a
time; one that runs past `timeout_s` is refused and the child killed and started again. Verdicts (compiles,
or why not, timeouts included) are cached in a segmented LRU, so a spec is compiled at most once while it
stays cached, and a flood of distinct specs cannot flush the verdicts of specs in repeated use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time

from distserve.segmented_lru import SegmentedLru

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # the child imports torch and builds the tokenizer's tables


class GrammarChecker:
    """One per router. check() is a coroutine; calls queue for the one child process."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids, timeout_s: float,
                 max_cached: int = 4096):
        self._command = [sys.executable, "-m", "services.router.grammar_worker", model_path, str(vocab_size),
                         json.dumps(list(eos_token_ids))]
        self.timeout_s = timeout_s
        self._verdicts: SegmentedLru[object, str] = SegmentedLru(max_cached, probation_capacity=max_cached // 4)
        self._child: asyncio.subprocess.Process | None = None
        self._next_child: asyncio.Future | None = None  # started after a kill, before it is needed
        self._lock = asyncio.Lock()
        self._in_flight: dict[object, asyncio.Future] = {}
        self.num_compiles = 0  # specs sent to the child
        self.num_killed = 0  # children killed at the deadline

    async def problem(self, spec) -> str:
        """"" when spec (a structured.StructuredSpec) compiles within timeout_s, else why not, starting with
        its kind ("regex: ..."), fit for INVALID_ARGUMENT. Raises RuntimeError when the compiler process
        cannot start. A caller cancelled while it waits leaves the compile running (its answer is cached):
        the child's pipe must never hold an answer nobody reads."""
        verdict = self._verdicts.get(spec)
        if verdict is not None:
            return verdict
        task = self._in_flight.get(spec)
        if task is None:
            task = self._in_flight[spec] = asyncio.ensure_future(self._verdict(spec))
            task.add_done_callback(lambda _: self._in_flight.pop(spec, None))
        return await asyncio.shield(task)

    async def _verdict(self, spec) -> str:
        async with self._lock:
            verdict = await self._compile(spec)
        self._verdicts.put(spec, verdict)
        return verdict

    async def close(self) -> None:
        """Kills the child (and one starting ahead of need)."""
        next_child, self._next_child = self._next_child, None
        if next_child is not None:
            next_child.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await _killed(await next_child)
        if self._child is not None:
            await _killed(self._child)
        self._child = None

    async def _compile(self, spec) -> str:
        child = await self._started()
        self.num_compiles += 1
        value = list(spec.value) if isinstance(spec.value, tuple) else spec.value
        child.stdin.write((json.dumps({"kind": spec.kind, "value": value}) + "\n").encode())
        started = time.monotonic()
        try:
            line = await asyncio.wait_for(child.stdout.readline(), self.timeout_s)
        except asyncio.TimeoutError:
            log.warning("a %s spec did not compile within %gs: refused, compiler restarted", spec.kind,
                        self.timeout_s)
            self.num_killed += 1
            await self.close()
            self._next_child = asyncio.ensure_future(self._spawn())  # ready before the next spec, usually
            return f"{spec.kind}: did not compile within {self.timeout_s:g}s (grammar_compile_timeout_s)"
        if not line:
            await self.close()
            return f"{spec.kind}: the grammar compiler failed on it (exited)"
        log.debug("compiled a %s spec in %.3fs", spec.kind, time.monotonic() - started)
        return json.loads(line)["problem"]

    async def _started(self) -> asyncio.subprocess.Process:
        if self._child is not None and self._child.returncode is None:
            return self._child
        next_child, self._next_child = self._next_child, None
        self._child = await (next_child or self._spawn())
        return self._child

    async def _spawn(self) -> asyncio.subprocess.Process:
        """A child that has built its tokenizer tables; RuntimeError when it does not get there."""
        child = await asyncio.create_subprocess_exec(*self._command, stdin=asyncio.subprocess.PIPE,
                                                     stdout=asyncio.subprocess.PIPE)
        try:
            ready = await asyncio.wait_for(child.stdout.readline(), START_TIMEOUT_S)
        except BaseException:
            await _killed(child)
            raise
        if json.loads(ready or b"{}").get("ready") is not True:
            await _killed(child)
            raise RuntimeError("the grammar compiler process did not start")
        return child


async def _killed(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        child.kill()
        await child.wait()
