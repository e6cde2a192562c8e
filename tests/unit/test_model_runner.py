"""ModelRunner (our own forward) on the real tiny model: packed prefill plus paged decode equals transformers' generate."""

from __future__ import annotations

import pytest
import torch

from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model_loader import load_engine_model, load_model
from distserve.engine.model_runner import DecodeWork, ModelRunner, PrefillWork
from distserve.engine.model_spec import load_model_spec
from tests.builders import compare_with_tolerance, reference_generate

BLOCK_SIZE = 4
NUM_NEW = 8


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cpu")


@pytest.fixture(scope="module")
def spec(tiny_model_path):
    return load_model_spec(tiny_model_path)


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
