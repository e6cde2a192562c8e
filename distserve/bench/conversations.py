"""Multi-turn chat as agents and chat UIs send it: each turn's prompt is the last turn's prompt, plus the
answer the server gave, plus the user's next message. A server that keeps what it computed for one turn
prefills only the new tokens of the next.

Conversations start on a Poisson schedule (`rate` conversations per second); within one, turn k + 1 is
sent `think_s` seconds after turn k's answer ends. Prompts are token ids (completions with a token-array
prompt, `return_token_ids` to read the answer's ids back), so the reuse a server can find is exact: no
chat template or re-tokenisation changes the history. Every conversation starts with the same system
prompt, drawn per run so a later run finds nothing cached from an earlier one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import numpy as np

from distserve.bench.client import BenchRequest, Endpoint, send_one
from distserve.bench.stats import RequestRecord
from distserve.bench.workload import synthetic_prompt


@dataclasses.dataclass(frozen=True)
class ChatShape:
    """The multi-turn workload's fixed defaults: 16 conversations of 4 turns, a 512-token system prompt
    shared by all, 128-token user turns, 64-token answers, 1 s of think time."""

    num_conversations: int = 16
    num_turns: int = 4
    system_len: int = 512
    user_len: int = 128
    answer_len: int = 64
    think_s: float = 1.0


@dataclasses.dataclass(frozen=True)
class Conversation:
    system: list[int]
    user_turns: list[list[int]]


def sample_conversations(shape: ChatShape, vocab_size: int, seed: int, run: int = 0) -> list[Conversation]:
    """The run's conversations: one shared system prompt, then each conversation's own user turns."""
    rng = np.random.default_rng([seed, 2, run])
    system = synthetic_prompt(shape.system_len, vocab_size, rng)
    return [Conversation(system, [synthetic_prompt(shape.user_len, vocab_size, rng) for _ in range(shape.num_turns)])
            for _ in range(shape.num_conversations)]


async def run_conversations(session: aiohttp.ClientSession, endpoint: Endpoint, conversations: list[Conversation],
                            arrivals: list[float], shape: ChatShape) -> tuple[list[RequestRecord], float]:
    """Runs every conversation from its arrival offset; returns every turn's record and the duration (s)."""
    start = time.perf_counter()

    async def one(conversation: Conversation, arrival_s: float) -> list[RequestRecord]:
        await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
        return await _converse(session, endpoint, conversation, shape, start)

    per_conversation = await asyncio.gather(*(one(c, a) for c, a in zip(conversations, arrivals)))
    return [record for records in per_conversation for record in records], time.perf_counter() - start


async def _converse(session: aiohttp.ClientSession, endpoint: Endpoint, conversation: Conversation,
                    shape: ChatShape, start: float) -> list[RequestRecord]:
    records, history = [], list(conversation.system)
    for turn, user in enumerate(conversation.user_turns):
        if turn:
            await asyncio.sleep(shape.think_s)
        prompt = history + user
        answer: list[int] = []
        record = await send_one(session, endpoint, BenchRequest(prompt, shape.answer_len),
                                time.perf_counter() - start, answer_ids=answer)
        records.append(record)
        if not record.ok:
            break  # the history is lost: later turns would not be the conversation any more
        if len(answer) != record.output_len:
            raise ValueError(f"{endpoint.url} returned {len(answer)} answer token ids for {record.output_len} "
                             "tokens: the multi-turn workload needs `return_token_ids` (vLLM and distserve)")
        history = prompt + answer
    return records
