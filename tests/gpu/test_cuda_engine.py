"""The engine on CUDA: greedy output through the whole system equals transformers' generate on the same
device in fp32, and the decode worker's KV cache is sized from its share of the GPU."""

from __future__ import annotations

import json

import pytest
import redis
import torch

from distserve.engine.decode_engine import build_decode_engine
from distserve.engine.model_loader import load_engine_model, load_model
from distserve.engine.model_runner import ModelRunner
from distserve.model_spec import load_model_spec
from tests.builders import compare_with_tolerance, generate, reference_generate, token_request

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference_model(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cuda")


def test_greedy_output_on_the_gpu_matches_transformers(gpu_fleet, reference_model):
    generator = torch.Generator().manual_seed(7)
    vocab = reference_model.config.vocab_size
    for length in (5, 64, 300):
        prompt = torch.randint(3, vocab, (length,), generator=generator).tolist()
        answer = generate(gpu_fleet.router_address, token_request(prompt, max_tokens=MAX_TOKENS))
        ok, detail = compare_with_tolerance(answer.token_ids, reference_generate(reference_model, prompt, MAX_TOKENS))
        assert ok, (length, detail)


def test_the_decode_worker_sizes_its_kv_cache_from_its_gpu_share(gpu_fleet):
    """Its share of GPU 0 (half of --gpu-memory-fraction 0.5, beside the prefill worker) less the tiny
    model's weights and activations: most of a quarter of the GPU, not the 64 MiB DECODE_TEST_ARGS asks for."""
    client = redis.Redis.from_url(gpu_fleet.redis_url)
    try:
        (key,) = client.keys("distserve:worker:decode:*")
        load = json.loads(client.get(key))["load"]
    finally:
        client.close()
    spec = load_model_spec(gpu_fleet.spec.model)
    cache_bytes = load["total_blocks"] * load["block_size"] * spec.kv_bytes_per_token(torch.float32)
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0.15 * total < cache_bytes < 0.25 * total


def test_a_decode_engine_on_the_gpu_keeps_its_cache_there(tiny_model_path):
    spec = load_model_spec(tiny_model_path)
    runner = ModelRunner(load_engine_model(tiny_model_path, "float32", "cuda"))
    engine = build_decode_engine(runner, spec, "float32", "cuda", block_size=16, kv_cache_mb=64, max_running=8,
                                 gpu_memory_fraction=0.2)
    assert engine.kv_cache.storage.device.type == "cuda"
    total = torch.cuda.get_device_properties(0).total_memory
    cache_bytes = engine.usage().num_blocks * 16 * spec.kv_bytes_per_token(torch.float32)
    assert 0.1 * total < cache_bytes < 0.2 * total  # this process's share, not the 64 MiB asked for on CPU
