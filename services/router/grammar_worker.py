"""python -m services.router.grammar_worker MODEL_PATH VOCAB_SIZE EOS_IDS: compiles structured-output specs
for the router's GrammarChecker, in a process it can kill when a compile runs past its deadline (a thread
cannot be stopped, and xgrammar's compiler never yields).

Protocol, one JSON object per line: stdin {"kind": ..., "value": str | [str, ...]}, stdout {"problem": ""}
when the spec compiles, else {"problem": "<kind>: <why>"} (structured.InvalidGrammar's message). It prints
{"ready": true} once its tokenizer tables are built.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    os.nice(10)  # below serving: a flood of slow specs (killed at the deadline, this process restarted)
    # takes only the CPU the workers and the router leave
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the answers
    model_path, vocab_size, eos_ids = argv[0], int(argv[1]), tuple(json.loads(argv[2]))
    from distserve.engine.model_loader import load_tokenizer
    from distserve.engine.structured import GrammarCompiler, InvalidGrammar, StructuredSpec
    # The router caches verdicts; compiled grammars are not kept here.
    compiler = GrammarCompiler(load_tokenizer(model_path), vocab_size, eos_ids, max_cached=2)
    _answer(answers, {"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        value = request["value"]
        try:
            compiler.compiled(StructuredSpec(request["kind"], tuple(value) if isinstance(value, list) else value))
            problem = ""
        except InvalidGrammar as exc:
            problem = str(exc)
        _answer(answers, {"problem": problem})
    return 0


def _answer(answers, message: dict) -> None:
    answers.write(json.dumps(message) + "\n")
    answers.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
