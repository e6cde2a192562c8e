"""python -m services.router.grammar_worker MODEL_PATH VOCAB_SIZE EOS_IDS LIMIT_S: checks structured-output
specs for the router's GrammarChecker, each in a process forked for it and killed when it has not finished
within LIMIT_S (a thread cannot be stopped, and xgrammar's compiler never yields).

This process is a zygote: it loads the tokenizer and xgrammar's tables once (torch and transformers
included: ~6 s of CPU and a few hundred MB of memory traffic), and each spec compiles in a fork of it,
which costs milliseconds. Before, a spec past the limit killed the compiler process and the next one
started from nothing, so a flood of slow specs kept a restart running all the time. It runs at nice 10,
below serving; the router also caps the CPU share compiles may take (grammar_check.CpuBudget).

Protocol, one JSON object per line: stdin {"kind": ..., "value": str | [str, ...]}, stdout {"problem": ""}
when the spec compiles, {"problem": "<kind>: <why>"} (structured.InvalidGrammar's message) when it does
not, {"over_limit": true} when it did not finish within LIMIT_S; each with "cpu_s", the CPU time the
compile took. It prints {"ready": true} once its tables are built. The router starts it in a session of
its own and kills the whole group (forks included).
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys


def main(argv: list[str]) -> int:
    os.nice(10)  # below serving, forks included
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the answers
    model_path, vocab_size, eos_ids = argv[0], int(argv[1]), tuple(json.loads(argv[2]))
    limit_s = float(argv[3])
    from distserve.engine.model_loader import load_tokenizer
    from distserve.engine.structured import GrammarCompiler
    # Compiles happen in forks only (so no compiler thread exists here to be lost in a fork), and each
    # fork's cache dies with it: the router keeps the verdicts.
    compiler = GrammarCompiler(load_tokenizer(model_path), vocab_size, eos_ids, max_cached=2, max_threads=1)
    _answer(answers, {"ready": True})
    for line in sys.stdin:
        _answer(answers, _checked_in_a_fork(compiler, json.loads(line), limit_s))
    return 0


def _checked_in_a_fork(compiler, request: dict, limit_s: float) -> dict:
    """The answer for one spec, compiled in a fork that is killed if it runs past limit_s."""
    readable, writable = os.pipe()
    pid = os.fork()
    if pid == 0:  # the fork: compile, answer through the pipe, leave without running any cleanup
        os.close(readable)
        try:
            os.write(writable, json.dumps({"problem": _problem(compiler, request)}).encode())
        finally:
            os._exit(0)
    os.close(writable)
    try:
        if not select.select([readable], [], [], limit_s)[0]:
            os.kill(pid, signal.SIGKILL)
            return {"over_limit": True, "cpu_s": _reaped_cpu_seconds(pid)}
        answer = b"".join(iter(lambda: os.read(readable, 65536), b""))
        reply = json.loads(answer) if answer else {"problem": f"{request['kind']}: the compiler failed on it"}
        return {**reply, "cpu_s": _reaped_cpu_seconds(pid)}
    finally:
        os.close(readable)


def _reaped_cpu_seconds(pid: int) -> float:
    """Waits for the fork to end; the CPU time it used, all of it (the fork's own accounting)."""
    usage = os.wait4(pid, 0)[2]
    return usage.ru_utime + usage.ru_stime


def _problem(compiler, request: dict) -> str:
    """"" when the spec compiles, else why not."""
    from distserve.engine.structured import InvalidGrammar, StructuredSpec

    value = request["value"]
    try:
        compiler.check(StructuredSpec(request["kind"], tuple(value) if isinstance(value, list) else value))
        return ""
    except InvalidGrammar as exc:
        return str(exc)


def _answer(answers, message: dict) -> None:
    answers.write(json.dumps(message) + "\n")
    answers.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
