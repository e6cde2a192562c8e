"""A process's grammar compiler, built on first use: most requests never constrain their output, so a
worker does not load xgrammar or its tokenizer tables until one does. Wraps structured.GrammarCompiler."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from distserve.engine.structured import GrammarCompiler, GrammarState, StructuredSpec


class LazyGrammarCompiler:
    """Thread-safe: the engines call it from their step threads, servers from the event loop."""

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: Sequence[int], tokenizer=None):
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._stop_token_ids = tuple(stop_token_ids)
        self._tokenizer = tokenizer  # the caller's, when it already has one (the router)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                from distserve.engine.model_loader import load_tokenizer
                from distserve.engine.structured import GrammarCompiler
                tokenizer = self._tokenizer or load_tokenizer(self._model_path)
                self._compiler = GrammarCompiler(tokenizer, self._vocab_size, self._stop_token_ids)
            return self._compiler

    def check(self, spec: StructuredSpec) -> None:
        """Compiles spec (cached) or raises structured.InvalidGrammar."""
        self.compiler().check(spec)

    def compiled(self, spec: StructuredSpec) -> CompiledGrammar:
        """spec's compiled grammar (cached), compiled in the calling thread: callers run it off the forward
        thread (asyncio.to_thread) and hand the result to matcher(), so no step waits on a compile."""
        return self.compiler().compiled(spec)

    def matcher(self, spec: StructuredSpec | CompiledGrammar, tokens_so_far: Sequence[int] = ()) -> GrammarState:
        """A sequence's grammar state, past the completion tokens it already has; spec may be what
        compiled() returned."""
        state = self.compiler().matcher(spec)
        state.accept_all(tokens_so_far)
        return state
