"""The router's check of structured-output specs: compiled in a child process under a deadline.

xgrammar compiles in native code that never yields, and some specs under the size cap never finish (an
ambiguous recursive grammar, say). Compiled in the router's threads, each such request would hold a
thread and a core for good. Here a child process (services.router.grammar_worker, a zygote that loaded
the tokenizer's tables once) compiles each spec in a fork of itself and kills a fork that runs past
`timeout_s`: the spec is refused. Compiles together use at most `cpu_share` of one core over time
(CpuBudget): a low priority alone does not keep a flood of slow specs off serving, since on a VM the
core a compile runs on may share a physical core and memory bandwidth with the workers' (compiling
nonstop at SCHED_IDLE slowed a decode worker's steps by 60% on a 2-vCPU EPYC;
benchmarks/results/security/README.md). A child that stops answering (wait_s) is killed with its forks
and started again; that caller gets CompilerBusy, a retryable error that is not cached. Verdicts
(compiles, or why not, over-limit ones included) are cached in a segmented LRU, so a spec is compiled at
most once while it stays cached, and a flood of distinct specs cannot flush the verdicts of specs in
repeated use.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time

from distserve.segmented_lru import SegmentedLru

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # the child imports torch and builds the tokenizer's tables
ANSWER_GRACE_S = 5.0  # wait_s, by default: timeout_s and this (the child stops a compile at timeout_s itself)


class CpuBudget:
    """A token bucket of CPU seconds: holds up to capacity_s, refills at `share` seconds per second. A
    compile may start while the level is not below 0 and is charged what it used afterwards, so cheap
    specs in a burst pass at once while slow ones, back to back, average `share` of a core."""

    def __init__(self, capacity_s: float, share: float, clock=time.monotonic):
        self.capacity_s, self.share, self._clock = capacity_s, share, clock
        self._level, self._at = capacity_s, clock()

    def level(self) -> float:
        now = self._clock()
        self._level, self._at = min(self.capacity_s, self._level + (now - self._at) * self.share), now
        return self._level

    def wait_s(self) -> float:
        """How long until a compile may start (0: now)."""
        return max(0.0, -self.level() / self.share)

    def charge(self, cpu_s: float) -> None:
        self._level = self.level() - cpu_s


class CompilerBusy(RuntimeError):
    """The compiler process gave no verdict within the wait; the spec may be fine."""


class GrammarChecker:
    """One per router. check() is a coroutine; calls queue for the one child process."""

    def __init__(self, model_path: str, vocab_size: int, eos_token_ids, timeout_s: float,
                 max_cached: int = 4096, wait_s: float | None = None, cpu_share: float = 0.1):
        """timeout_s: how long a spec's compile may run; wait_s (default timeout_s + ANSWER_GRACE_S): how
        long the child may take to answer before it is taken for hung; cpu_share: of one core, what
        compiles may use over time (a bucket of timeout_s CPU seconds)."""
        self.budget = CpuBudget(timeout_s, cpu_share)
        self._command = [sys.executable, "-m", "services.router.grammar_worker", model_path, str(vocab_size),
                         json.dumps(list(eos_token_ids)), repr(timeout_s)]
        self.timeout_s = timeout_s
        self.wait_s = timeout_s + ANSWER_GRACE_S if wait_s is None else wait_s
        self._verdicts: SegmentedLru[object, str] = SegmentedLru(max_cached, probation_capacity=max_cached // 4)
        self._child: asyncio.subprocess.Process | None = None
        self._next_child: asyncio.Future | None = None  # started after a kill, before it is needed
        self._lock = asyncio.Lock()
        self._in_flight: dict[object, asyncio.Future] = {}
        self.num_compiles = 0  # specs sent to the child
        self.num_over_limit = 0  # specs refused for running past timeout_s

    async def problem(self, spec) -> str:
        """"" when spec (a structured.StructuredSpec) compiles within timeout_s, else why not, starting with
        its kind ("regex: ..."), fit for INVALID_ARGUMENT. Raises CompilerBusy when no verdict came within
        wait_s, RuntimeError when the compiler process cannot start (neither is cached). A caller
        cancelled while it waits leaves the compile running (its answer is cached): the child's pipe must
        never hold an answer nobody reads."""
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
            await asyncio.sleep(self.budget.wait_s())
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
            line = await asyncio.wait_for(child.stdout.readline(), self.wait_s)
        except asyncio.TimeoutError:
            log.warning("the grammar compiler gave no verdict on a %s spec within %gs: restarted", spec.kind,
                        self.wait_s)
            await self.close()
            self._next_child = asyncio.ensure_future(self._spawn())  # ready before the next spec, usually
            raise CompilerBusy(f"the compiler gave no verdict within {self.wait_s:g}s; retry later") from None
        if not line:
            await self.close()
            return f"{spec.kind}: the grammar compiler failed on it (exited)"
        answer = json.loads(line)
        self.budget.charge(answer["cpu_s"])
        if answer.get("over_limit"):
            self.num_over_limit += 1
            log.warning("a %s spec did not compile within %gs: refused", spec.kind, self.timeout_s)
            return f"{spec.kind}: did not compile within {self.timeout_s:g}s (grammar_compile_timeout_s)"
        log.debug("compiled a %s spec in %.3fs", spec.kind, time.monotonic() - started)
        return answer["problem"]

    async def _started(self) -> asyncio.subprocess.Process:
        if self._child is not None and self._child.returncode is None:
            return self._child
        next_child, self._next_child = self._next_child, None
        self._child = await (next_child or self._spawn())
        return self._child

    async def _spawn(self) -> asyncio.subprocess.Process:
        """A child that has built its tokenizer tables; RuntimeError when it does not get there."""
        # A session of its own: _killed takes the compile forks down with it.
        child = await asyncio.create_subprocess_exec(*self._command, stdin=asyncio.subprocess.PIPE,
                                                     stdout=asyncio.subprocess.PIPE, start_new_session=True)
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
    """Kills the child's process group: the child and any compile fork of it."""
    if child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        await child.wait()
