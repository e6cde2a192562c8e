"""Runs our Llama-family forward for serving: packed (chunked) prefill and paged decode steps.

The runner turns Python lists (token ids, block tables) into the tensors the model reads, on the
model's device, and hands back float32 logits on the CPU. It holds no per-request state.
"""

from __future__ import annotations

import dataclasses

import torch

from distserve.engine.kv_cache import PagedKvCache
from distserve.engine.model import LlamaModel, PagedStep, PrefillChunk


@dataclasses.dataclass
class PrefillWork:
    """One prompt's chunk in a prefill batch."""

    token_ids: list[int]  # this chunk's tokens
    position: int  # position of token_ids[0] in the prompt
    kv: torch.Tensor  # the prompt's KV buffer [L, 2, T_prompt, Hkv, D]
    is_last: bool  # the chunk ends the prompt: its last token's logits are wanted
    wants_all_logits: bool = False  # logits at every position of the chunk too (prompt logprobs)
    all_logits: torch.Tensor | None = None  # output: [len(token_ids), V] float32 CPU, when wanted


@dataclasses.dataclass
class DecodeWork:
    """The decoding sequences of a step: sequence b feeds input_ids[b] at position context_lens[b]."""

    kv_cache: PagedKvCache
    tables: list[list[int]]  # tables[b] covers context_lens[b] + 1 tokens
    context_lens: list[int]
    input_ids: list[int]


class ModelRunner:
    """Owns the model; thread-agnostic (the engines run it in a worker thread)."""

    def __init__(self, model: LlamaModel):
        self.model = model
        self.device = model.device

    def warm_up(self) -> None:
        """Runs a tiny prefill and decode steps at batch 1 and 2, so that no request pays the one-time
        costs (oneDNN weight packing, kernel and primitive set-up: ~80 ms on the default model)."""
        a = self.model.args
        kv = self.new_kv_buffer(8)
        self.prefill_chunks([PrefillWork(list(range(8)), 0, kv, True)])
        cache = PagedKvCache(a.num_layers, a.num_kv_heads, a.head_dim, 2, 16, self.model.dtype, self.device)
        for block in (0, 1):
            cache.write_prompt([block], kv)
        self.decode(cache, [[0]], [8], [1])
        self.decode(cache, [[0], [1]], [9, 8], [1, 2])

    def new_kv_buffer(self, num_tokens: int) -> torch.Tensor:
        """An uninitialised prompt KV buffer [L, 2, T, Hkv, D]; prefill fills every element."""
        a = self.model.args
        return torch.empty((a.num_layers, 2, num_tokens, a.num_kv_heads, a.head_dim),
                           dtype=self.model.dtype, device=self.device)

    def prefill_chunks(self, works: list[PrefillWork]) -> torch.Tensor:
        """One packed forward over every chunk. Returns float32 logits [num last chunks, V] on the
        CPU, in the order of the works whose is_last is set."""
        return self.step(works, None)[0]

    def step(self, works: list[PrefillWork], decode: DecodeWork | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One fused forward over prompt chunks and decoding sequences (a colocated worker's step).

        Returns float32 CPU logits: [num works with is_last, V] in their order, and [B, V] for the
        decoding sequences (None without them). Works with wants_all_logits get all_logits set.
        """
        ids, positions, chunks, last_rows, every_row = [], [], [], [], []
        for work in works:
            start, n = len(ids), len(work.token_ids)
            ids += work.token_ids
            positions += range(work.position, work.position + n)
            chunks.append(PrefillChunk(start, n, work.position, work.kv))
            if work.is_last:
                last_rows.append(start + n - 1)
            if work.wants_all_logits:
                every_row += range(start, start + n)
        num_prompt_rows = len(ids)
        # logits rows: the last rows, then every row of the works that want them all, then decode rows
        rows = last_rows + every_row
        if decode is not None:
            rows += range(len(ids), len(ids) + len(decode.input_ids))
            ids += decode.input_ids
            positions += decode.context_lens
        positions_t = torch.tensor(positions, device=self.device)
        paged = None if decode is None else self._paged_step(decode, positions_t[num_prompt_rows:])
        logits = self.model.forward(torch.tensor(ids, device=self.device), positions_t, chunks, paged, rows).cpu()
        offset = len(last_rows)
        for work in works:
            if work.wants_all_logits:
                work.all_logits = logits[offset:offset + len(work.token_ids)]
                offset += len(work.token_ids)
        return logits[:len(last_rows)], (logits[offset:] if decode is not None else None)

    def _paged_step(self, decode: DecodeWork, positions: torch.Tensor) -> PagedStep:
        """positions: [B], the decoding rows' positions (their context lengths), already on the device."""
        cache = decode.kv_cache
        return PagedStep(cache, cache.block_table_tensor(decode.tables, [n + 1 for n in decode.context_lens]),
                         positions, cache.slot_tensor(decode.tables, decode.context_lens),
                         self.model.args.sliding_window)

    def prefill(self, prompts: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Whole prompts in one packed batch: last-token logits [B, V] and each prompt's KV
        [L, 2, T_i, Hkv, D] (token-major, the layout that is sent)."""
        kvs = [self.new_kv_buffer(len(p)) for p in prompts]
        logits = self.prefill_chunks([PrefillWork(p, 0, kv, True) for p, kv in zip(prompts, kvs)])
        return logits, kvs

    def decode(self, kv_cache: PagedKvCache, tables: list[list[int]], context_lens: list[int],
               input_ids: list[int]) -> torch.Tensor:
        """One decode step: feeds input_ids[b] at position context_lens[b], writing its KV in place.

        tables[b] must cover context_lens[b] + 1 tokens. Returns next-token logits [B, V] (float32, CPU).
        """
        return self.step([], DecodeWork(kv_cache, tables, context_lens, input_ids))[1]
