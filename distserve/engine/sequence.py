"""A sequence being decoded: plain data shared by the scheduler, engine and server."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, AsyncIterator

from distserve.request_types import TokenLogprobs
from distserve.request_types import FinishReason, SamplingParams

if TYPE_CHECKING:
    from distserve.engine.structured import GrammarState


@dataclasses.dataclass
class Sequence:
    request_id: str
    tokens: list[int]  # prompt + completion so far; the last one has no KV yet
    prompt_len: int
    params: SamplingParams
    block_table: list[int]
    outputs: asyncio.Queue  # (token_ids, finish_reason | None, logprobs) tuples for the stream, or an error
    finish_reason: FinishReason | None = None
    is_aborted: bool = False
    loaded_at: float = dataclasses.field(default_factory=time.monotonic)
    started_at: float = 0.0  # joined the running batch
    finished_at: float = 0.0
    grammar: GrammarState | None = None  # a constrained sequence's grammar, past its tokens so far
    num_steps: int = 0  # decode steps it was in
    batch_size_sum: int = 0  # the sizes of those steps' batches, summed
    block_keys: list[bytes] = dataclasses.field(default_factory=list)  # prefix keys of its first full blocks

    @property
    def mean_batch_size(self) -> float:
        return self.batch_size_sum / self.num_steps if self.num_steps else 0.0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def context_len(self) -> int:
        """Tokens whose KV is in the cache."""
        return len(self.tokens) - 1


async def stream_outputs(seq: Sequence) -> AsyncIterator[tuple[list[int], FinishReason | None, list[TokenLogprobs]]]:
    """The sequence's tokens (and their logprobs, when asked for: parallel, else empty) as the engine
    posts them, coalescing whatever queued up meanwhile into one message; ends after the message
    carrying the finish reason. Raises the engine's error for this sequence (e.g. a failed step)
    if one is posted."""
    while True:
        item = await seq.outputs.get()
        if isinstance(item, Exception):
            raise item
        token_ids, finish, logprobs = item
        while finish is None and not seq.outputs.empty():
            more = seq.outputs.get_nowait()
            if isinstance(more, Exception):
                raise more
            token_ids, finish, logprobs = token_ids + more[0], more[1], logprobs + more[2]
        yield token_ids, finish, logprobs
        if finish is not None:
            return
