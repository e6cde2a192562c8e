"""ModelRunner (our own forward) on the real tiny model: packed prefill plus paged decode equals transformers' generate."""

from __future__ import annotations

import pytest
import torch

from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model import PrefillChunk, last_layer_rows
from distserve.engine.model_loader import load_engine_model, load_model
from distserve.engine.model_runner import DecodeWork, ModelRunner, PrefillWork
from tests.builders import compare_with_tolerance, reference_generate

BLOCK_SIZE = 4
NUM_NEW = 8


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cpu")


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(load_engine_model(tiny_model_path, "float32", "cpu"))


@pytest.fixture(scope="module")
def prompts(spec):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(5, spec.vocab_size, (n,), generator=generator).tolist() for n in (5, 17, 40, 3)]


def new_cache(spec, num_blocks: int = 64) -> PagedKvCache:
    return PagedKvCache(spec.num_layers, spec.num_kv_heads, spec.head_dim, num_blocks, BLOCK_SIZE,
                        torch.float32, "cpu")


def greedy_generate(runner, cache, prompts, num_new):
    """Batched prefill, then paged greedy decode steps; returns the tokens per prompt."""
    logits, kvs = runner.prefill(prompts)
    tables = []
    for prompt, kv in zip(prompts, kvs):
        table = cache.allocator.allocate(blocks_needed(len(prompt) + num_new, BLOCK_SIZE))
        cache.write_prompt(table, kv)
        tables.append(table)
    outputs = [[t] for t in logits.argmax(-1).tolist()]
    lengths = [len(p) for p in prompts]
    for _ in range(num_new - 1):
        step = runner.decode(cache, tables, lengths, [out[-1] for out in outputs])
        for out, token in zip(outputs, step.argmax(-1).tolist()):
            out.append(token)
        lengths = [n + 1 for n in lengths]
    return outputs


def test_prefill_returns_last_token_logits_and_per_prompt_kv(runner, spec, prompts):
    logits, kvs = runner.prefill(prompts)
    assert logits.shape == (len(prompts), spec.vocab_size) and logits.dtype == torch.float32
    assert len(kvs) == len(prompts)
    for prompt, kv in zip(prompts, kvs):
        assert kv.shape == (spec.num_layers, 2, len(prompt), spec.num_kv_heads, spec.head_dim)
        assert kv.device.type == "cpu" and kv.is_contiguous()


def test_batched_prefill_equals_prefill_alone(runner, prompts):
    """Packing prompts together must not change any prompt's logits or KV."""
    logits, kvs = runner.prefill(prompts)
    for b, prompt in enumerate(prompts):
        alone_logits, (alone_kv,) = runner.prefill([prompt])
        torch.testing.assert_close(logits[b], alone_logits[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kvs[b], alone_kv, atol=1e-4, rtol=1e-4)


def test_prefill_and_paged_decode_match_transformers_generate(runner, model, spec, prompts):
    got = greedy_generate(runner, new_cache(spec), prompts, NUM_NEW)
    for prompt, tokens in zip(prompts, got):
        matches, _ = compare_with_tolerance(tokens, reference_generate(model, prompt, NUM_NEW))
        assert matches, (prompt, tokens)


def test_decode_writes_the_new_tokens_kv_into_the_cache(runner, spec, prompts):
    prompt = prompts[1]
    cache = new_cache(spec)
    logits, (kv,) = runner.prefill([prompt])
    table = cache.allocator.allocate(blocks_needed(len(prompt) + 1, BLOCK_SIZE))
    cache.write_prompt(table, kv)
    first = int(logits[0].argmax())

    decode_logits = runner.decode(cache, [table], [len(prompt)], [first])

    full_logits, (full_kv,) = runner.prefill([prompt + [first]])
    torch.testing.assert_close(cache.gather([table], [len(prompt) + 1])[:, :, 0], full_kv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decode_logits[0], full_logits[0], atol=1e-4, rtol=1e-4)


def test_warm_up_leaves_no_state_behind(runner, prompts):
    before, _ = runner.prefill([prompts[0]])
    runner.warm_up()
    after, _ = runner.prefill([prompts[0]])
    torch.testing.assert_close(after, before)


def test_mixed_step_equals_separate_prefill_and_decode(runner, spec, prompts):
    """A fused step (prompt chunks + decoding sequences) gives the logits each kind gives alone."""
    decoding, new_prompt = prompts[:2], prompts[2]
    cache = new_cache(spec)
    logits, kvs = runner.prefill(decoding)
    tables = []
    for prompt, kv in zip(decoding, kvs):
        tables.append(cache.allocator.allocate(blocks_needed(len(prompt) + 2, BLOCK_SIZE)))
        cache.write_prompt(tables[-1], kv)
    firsts = logits.argmax(-1).tolist()
    lengths = [len(p) for p in decoding]
    alone_decode = runner.decode(cache, tables, lengths, firsts)
    alone_prefill = runner.prefill([new_prompt])[0]

    kv = runner.new_kv_buffer(len(new_prompt))
    half = len(new_prompt) // 2
    runner.step([PrefillWork(new_prompt[:half], 0, kv, False)], None)
    mixed_prefill, mixed_decode = runner.step([PrefillWork(new_prompt[half:], half, kv, True)],
                                              DecodeWork(cache, tables, lengths, firsts))
    torch.testing.assert_close(mixed_prefill, alone_prefill, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mixed_decode, alone_decode, rtol=1e-4, atol=1e-4)


def _forward_with_every_row(runner, prompt_chunks):
    """model.forward over (tokens, position, kv) chunks: logits for every row, so no row is pruned."""
    ids, positions, chunks = [], [], []
    for tokens, position, kv in prompt_chunks:
        chunks.append(PrefillChunk(len(ids), len(tokens), position, kv))
        ids += tokens
        positions += range(position, position + len(tokens))
    logits = runner.model.forward(torch.tensor(ids), torch.tensor(positions), chunks, None, list(range(len(ids))))
    return logits, chunks


def test_last_layer_keeps_only_rows_whose_logits_are_wanted(runner, prompts):
    """Pruning the last layer to the wanted rows gives those rows' logits and every K/V as computing all rows."""
    first, second, third = prompts[1], prompts[2], prompts[0]
    kvs = [runner.new_kv_buffer(len(p)) for p in (first, second, third)]
    ref_kvs = [kv.clone() for kv in kvs]
    # second's first 10 tokens are already in its buffer: this step prefills its tokens [10, 25), not its last
    runner.prefill_chunks([PrefillWork(second[:10], 0, kvs[1], False)])
    ref_kvs[1][:, :, :10] = kvs[1][:, :, :10]
    works = [PrefillWork(first, 0, kvs[0], True), PrefillWork(second[10:25], 10, kvs[1], False),
             PrefillWork(third, 0, kvs[2], True, wants_all_logits=True)]
    last_logits = runner.prefill_chunks(works)

    every, chunks = _forward_with_every_row(runner, [(first, 0, ref_kvs[0]), (second[10:25], 10, ref_kvs[1]),
                                                     (third, 0, ref_kvs[2])])
    third_rows = slice(chunks[2].start, chunks[2].start + len(third))
    torch.testing.assert_close(last_logits, every[[len(first) - 1, chunks[2].start + len(third) - 1]],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(works[2].all_logits, every[third_rows], rtol=1e-5, atol=1e-5)
    for kv, ref in zip(kvs, ref_kvs):
        written = slice(0, 25) if kv.shape[2] == len(second) else slice(None)
        torch.testing.assert_close(kv[:, :, written], ref[:, :, written], rtol=0, atol=0)


def test_last_layer_rows_plans_trailing_rows_per_chunk():
    kv = torch.empty(1)
    chunks = [PrefillChunk(0, 5, 0, kv), PrefillChunk(5, 3, 7, kv), PrefillChunk(8, 4, 0, kv)]
    plan = last_layer_rows(chunks, 14, [4, 8, 9, 10, 11, 11, 12, 13])  # chunk 1 wants nothing; 2 decode rows
    assert plan.queries == [1, 0, 4]
    assert plan.keep.tolist() == [4, 8, 9, 10, 11, 12, 13]
    assert plan.logits_rows == [0, 1, 2, 3, 4, 4, 5, 6]
    assert last_layer_rows(chunks, 12, list(range(12))) is None  # every row wanted: nothing to prune
    assert last_layer_rows([], 3, slice(None)) is None


def test_a_step_with_no_wanted_logits_still_stores_every_layers_kv(runner, prompts):
    prompt = prompts[2]
    kv = runner.new_kv_buffer(len(prompt))
    kv.fill_(float("nan"))
    assert runner.prefill_chunks([PrefillWork(prompt[:20], 0, kv, False)]).shape[0] == 0
    ref = runner.new_kv_buffer(len(prompt))
    _forward_with_every_row(runner, [(prompt[:20], 0, ref)])
    torch.testing.assert_close(kv[:, :, :20], ref[:, :, :20], rtol=0, atol=0)
