"""Builders shared by tests: requests, clients, the reference generator and unit-test data."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import torch

from distserve.engine.colocated_engine import ColocatedEngine
from distserve.engine.decode_engine import DecodeEngine
from distserve.engine.decode_scheduler import DecodeScheduler
from distserve.engine.kv_cache import BlockAllocator, PagedKvCache, blocks_needed
from distserve.engine.model_runner import ModelRunner
from distserve.engine.prefill_batcher import PrefillBatcher
from distserve.model_spec import ModelSpec
from distserve.prefix_hash import PrefixNamespace
from distserve.request_types import SamplingParams
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from distserve.engine.sequence import Sequence, stream_outputs


def sampling(max_tokens: int = 16, temperature: float = 0.0, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, **kwargs)


def token_request(ids: list[int], **kwargs) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling=sampling(**kwargs))


@dataclasses.dataclass
class Answer:
    token_ids: list[int]
    text: str
    messages: list[router_pb2.GenerateResponse]

    @property
    def last(self) -> router_pb2.GenerateResponse:
        return self.messages[-1]


def generate(address: str, request: router_pb2.GenerateRequest, timeout: float = 300) -> Answer:
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        messages = list(stub.Generate(request, timeout=timeout))
    ids = [t for m in messages for t in m.token_ids]
    return Answer(ids, "".join(m.text for m in messages), messages)


@dataclasses.dataclass
class Reference:
    """Greedy tokens from transformers' generate, with each step's top-2 logit gap."""

    token_ids: list[int]
    top2_gaps: list[float]
    top2_ids: list[tuple[int, int]]


def reference_generate(model, prompt: list[int], max_new_tokens: int) -> Reference:
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps, ids = [], []
    for logits in out.logits:
        top2 = torch.topk(logits[0].float(), 2)
        gaps.append(float(top2.values[0] - top2.values[1]))
        ids.append((int(top2.indices[0]), int(top2.indices[1])))
    return Reference(tokens, gaps, ids)


def compare_with_tolerance(got: list[int], ref: Reference, tie_eps: float = 1e-4) -> tuple[bool, bool]:
    """(matches, hit_tie). At a near-tie (top-2 within tie_eps) either token is accepted and
    comparison stops there, since batch shapes change float rounding."""
    for i, expected in enumerate(ref.token_ids):
        if i >= len(got):
            return False, False
        if ref.top2_gaps[i] < tie_eps:
            return got[i] in ref.top2_ids[i], True
        if got[i] != expected:
            return False, False
    return len(got) == len(ref.token_ids), False


def runner_greedy(runner: ModelRunner, prompt: list[int], num_new: int, block_size: int = 4) -> list[int]:
    """Greedy tokens through the engine's own steps, as a worker runs them: one prefill, its KV written
    into a paged cache, then num_new - 1 decode steps at batch 1."""
    a = runner.model.args
    num_blocks = blocks_needed(len(prompt) + num_new, block_size)
    cache = PagedKvCache(a.num_layers, a.num_kv_heads, a.head_dim, num_blocks, block_size, runner.model.dtype, "cpu")
    logits, (kv,) = runner.prefill([prompt])
    table = cache.allocator.allocate(num_blocks)
    cache.write_prompt(table, kv)
    out = [int(logits[0].argmax())]
    for step in range(num_new - 1):
        out.append(int(runner.decode(cache, [table], [len(prompt) + step], [out[-1]])[0].argmax()))
    return out


# --- unit-test data ---------------------------------------------------------


def model_spec(vocab_size: int = 100, max_context: int = 64, eos_token_ids: tuple[int, ...] = (1,),
               num_layers: int = 2, num_kv_heads: int = 2, head_dim: int = 4) -> ModelSpec:
    """A hand-built ModelSpec small enough to reason about in tests."""
    return ModelSpec(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     vocab_size=vocab_size, max_context=max_context, eos_token_ids=eos_token_ids)


def random_kv(num_tokens: int, spec: ModelSpec, seed: int = 0) -> torch.Tensor:
    """Random contiguous prompt KV: [L, 2, T, H, D] (token-major, as prefill sends it)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=generator)


def decode_sequence(request_id: str = "r", prompt_len: int = 4, block_table: list[int] | None = None,
                    **params) -> Sequence:
    """A decode Sequence holding a prompt of prompt_len tokens plus its first token."""
    return Sequence(request_id=request_id, tokens=list(range(2, prompt_len + 3)), prompt_len=prompt_len,
                    params=SamplingParams(**params), block_table=list(block_table or []),
                    outputs=asyncio.Queue())


def engine_with_blocks(num_blocks: int) -> DecodeEngine:
    """A decode engine with no model: enough to exercise block reservation and admission."""
    scheduler = DecodeScheduler(BlockAllocator(num_blocks), block_size=4, max_running=8, max_context=1024)
    return DecodeEngine(runner=None, kv_cache=None, scheduler=scheduler, eos_ids=(), max_context=1024)


def engine_with_runner(runner: ModelRunner, token_lists: list[list[int]], params: list[SamplingParams],
                       block_size: int = 4, num_blocks: int = 64) -> tuple[DecodeEngine, list[Sequence]]:
    """A decode engine over a real runner, and one sequence per token list, ready for a step: the KV of
    all but each list's last token is in the cache (prefilled), the last one is the token to feed."""
    a = runner.model.args
    cache = PagedKvCache(a.num_layers, a.num_kv_heads, a.head_dim, num_blocks, block_size, runner.model.dtype, "cpu")
    scheduler = DecodeScheduler(cache.allocator, block_size=block_size, max_running=8, max_context=1024)
    engine = DecodeEngine(runner, cache, scheduler, eos_ids=(), max_context=1024)
    _, kvs = runner.prefill([tokens[:-1] for tokens in token_lists])
    seqs = []
    for i, (tokens, kv, seq_params) in enumerate(zip(token_lists, kvs, params)):
        table = cache.allocator.allocate(blocks_needed(len(tokens) + 8, block_size))
        cache.write_prompt(table, kv)
        seqs.append(Sequence(f"r{i}", list(tokens), len(tokens) - 1, seq_params, table, asyncio.Queue()))
    return engine, seqs


def colocated_engine(runner: ModelRunner, spec: ModelSpec, *, block_size: int = 16, num_blocks: int = 64,
                     token_budget: int = 256, prefix: PrefixNamespace | None = None) -> ColocatedEngine:
    """A float32 CPU colocated engine over `runner`, as the colocated worker assembles one; `prefix` lists
    finished sequences' blocks for the prefill side to reuse (PagedPrefix)."""
    cache = PagedKvCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks, block_size, torch.float32,
                         "cpu")
    wakeup = asyncio.Event()
    prefill = PrefillBatcher(runner, spec.eos_token_ids, spec.max_context, token_budget, wakeup)
    scheduler = DecodeScheduler(cache.allocator, block_size, 8, spec.max_context)
    decode = DecodeEngine(runner, cache, scheduler, spec.eos_token_ids, spec.max_context, wakeup, prefix=prefix)
    return ColocatedEngine(prefill, decode, wakeup)


async def serve_colocated(engine: ColocatedEngine, prompt: list[int], max_tokens: int,
                          request_id: str = "r") -> tuple[list[int], int]:
    """One greedy request as the colocated servicer serves it, minus gRPC: its tokens and its cached
    prompt tokens. The engine's loop (engine.run()) must be running."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    blocks = await engine.decode.reserve(engine.decode.scheduler.blocks_for(len(prompt), max_tokens))
    result = await engine.prefill.submit(prompt, params)
    seq = Sequence(request_id, prompt + [result.first_token], len(prompt), params, blocks, asyncio.Queue())
    engine.hand_off(result, seq)
    tokens = [result.first_token]
    async for token_ids, _, _ in stream_outputs(seq):
        tokens += token_ids
    return tokens, result.num_cached_tokens
