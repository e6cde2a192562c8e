"""A sequence being decoded: plain data shared by the scheduler, engine and server."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from distserve.engine.sampling import FinishReason, SamplingParams


@dataclasses.dataclass
class Sequence:
    request_id: str
    tokens: list[int]  # prompt + completion so far; the last one has no KV yet
    prompt_len: int
    params: SamplingParams
    block_table: list[int]
    outputs: asyncio.Queue  # (token_ids, finish_reason | None) tuples for the stream
    finish_reason: FinishReason | None = None
    is_aborted: bool = False
    loaded_at: float = dataclasses.field(default_factory=time.monotonic)
    started_at: float = 0.0  # joined the running batch
    finished_at: float = 0.0

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def context_len(self) -> int:
        """Tokens whose KV is in the cache."""
        return len(self.tokens) - 1
