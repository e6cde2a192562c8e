"""Our forward against transformers on small random Llama (RoPE scaling, tied embeddings), Mistral
(sliding window) and Qwen2 (q/k/v bias) models: greedy output token for token, and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model_loader import load_engine_model, load_model
from distserve.engine.model_runner import ModelRunner, PrefillWork
from tests.builders import compare_with_tolerance, reference_generate, runner_greedy
from tests.kernel_support import cpu_runs

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", dict()),
}
NUM_NEW = 10
BLOCK_SIZE = 4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_folder(request, tmp_path_factory):
    import transformers

    config_class, extra = FAMILIES[request.param]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return str(folder)


def test_greedy_output_equals_transformers_generate(model_folder):
    reference_model = load_model(model_folder, "float32", "cpu")
    runner = ModelRunner(load_engine_model(model_folder, "float32", "cpu"))
    if "qwen2" in model_folder:
        assert runner.model.weights.layers[0].qkv.bias is not None
    for length in (3, 21):  # 21 > the Mistral window of 8
        prompt = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        matches, _ = compare_with_tolerance(runner_greedy(runner, prompt, NUM_NEW, BLOCK_SIZE),
                                            reference_generate(reference_model, prompt, NUM_NEW))
        assert matches, (model_folder, prompt)


def test_chunked_prefill_equals_whole_prefill(model_folder):
    runner = ModelRunner(load_engine_model(model_folder, "float32", "cpu"))
    prompt = list(range(10, 40))
    logits, (whole_kv,) = runner.prefill([prompt])
    kv = runner.new_kv_buffer(len(prompt))
    for begin, end in [(0, 11), (11, 12), (12, 30)]:
        last = runner.prefill_chunks([PrefillWork(prompt[begin:end], begin, kv, end == len(prompt))])
    torch.testing.assert_close(last, logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv, whole_kv, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def head_dim_64_folder(request, tmp_path_factory):
    """The same families with head_dim 64, the size our compiled bf16 kernels take."""
    import transformers

    config_class, extra = FAMILIES[request.param]
    config = getattr(transformers, config_class)(**{**COMMON, "hidden_size": 256, "intermediate_size": 160}, **extra)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    folder = tmp_path_factory.mktemp(request.param + "-64")
    model.save_pretrained(folder)
    return str(folder)


def test_bf16_prefill_with_compiled_kernels_tracks_float32_transformers(head_dim_64_folder, monkeypatch):
    """bf16 prefill (our prefill attention, fused norm/RoPE/MLP kernels, Mistral's window included) stays as
    close to float32 transformers as bf16 rounding allows: the same bound torch's own ops meet."""
    import distserve.engine.attention as attention

    monkeypatch.setattr(attention, "cpu_has_amx", lambda: False)  # our attention even where AMX makes SDPA the pick
    runner = ModelRunner(load_engine_model(head_dim_64_folder, "bfloat16", "cpu"))
    has_kernels = cpu_runs("add_rms_norm_bf16")  # without AVX512-BF16: torch's ops, under the same bound
    assert (runner.model.fused_small_ops is not None) == has_kernels
    assert (runner.model.fused_silu_mul is not None) == has_kernels
    assert (attention.prefill_kernel(torch.empty(1, 4, 64, dtype=torch.bfloat16)) is not None) == has_kernels
    reference_model = load_model(head_dim_64_folder, "float32", "cpu")
    prompt = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        expected = reference_model(torch.tensor([prompt])).logits[0, -1]
    logits, _ = runner.prefill([prompt])
    relative_error = float((logits[0] - expected).norm() / expected.norm())
    assert relative_error < 0.02, relative_error  # torch's ops: ~0.0065 here, and so do ours


def test_bf16_decode_with_compiled_kernels_tracks_float32_transformers(head_dim_64_folder):
    """The decode rows of a bf16 step (paged attention, fused norm/RoPE/MLP kernels) too."""
    runner = ModelRunner(load_engine_model(head_dim_64_folder, "bfloat16", "cpu"))
    reference_model = load_model(head_dim_64_folder, "float32", "cpu")
    tokens = torch.randint(0, 300, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    _, (kv,) = runner.prefill([tokens])
    cache = PagedKvCache(2, 2, 64, 16, BLOCK_SIZE, torch.bfloat16, "cpu")
    table = cache.allocator.allocate(blocks_needed(len(tokens) + 4, BLOCK_SIZE))
    cache.write_prompt(table, kv)
    for step, token in enumerate([5, 17, 250]):
        logits = runner.decode(cache, [table], [len(tokens)], [token])[0]
        tokens.append(token)
        with torch.no_grad():
            expected = reference_model(torch.tensor([tokens])).logits[0, -1]
        relative_error = float((logits - expected).norm() / expected.norm())
        assert relative_error < 0.02, (step, relative_error)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_decode_layer_equals_the_python_layer(head_dim_64_folder, dtype):
    """csrc/decode_layer.cpp runs model.py's maths op for op: decode steps at batch 1 and 3 give bitwise
    the same logits and KV with it as through the Python layer (Mistral's window, Qwen2's qkv bias)."""
    runner = ModelRunner(load_engine_model(head_dim_64_folder, dtype, "cpu"))
    model, compiled = runner.model, runner.model.compiled_decode_layer
    # it needs our tiled decode attention for the dtype (and in bf16 the fused kernels)
    assert (compiled is not None) == cpu_runs("paged_decode_attention_" + ("f32" if dtype == "float32" else "bf16"))
    if compiled is None:  # every decode step runs the Python layer
        return
    calls = []

    def counted(*args):
        calls.append(1)
        return compiled(*args)

    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (30, 9, 17)]
    outputs = {}
    for layer_op in (counted, None):
        model.compiled_decode_layer = layer_op
        cache = PagedKvCache(2, 2, 64, 48, BLOCK_SIZE, getattr(torch, dtype), "cpu")
        tables = []
        for prompt in prompts:
            _, (kv,) = runner.prefill([prompt])
            tables.append(cache.allocator.allocate(blocks_needed(len(prompt) + 2, BLOCK_SIZE)))
            cache.write_prompt(tables[-1], kv)
        first = runner.decode(cache, tables[:1], [len(prompts[0])], [5])
        lengths = [len(prompts[0]) + 1] + [len(p) for p in prompts[1:]]
        second = runner.decode(cache, tables, lengths, [6, 7, 8])
        outputs[layer_op is not None] = (first, second, cache.storage.clone())
    # steps at batch 1 and 3, of two layers each, go through the compiled layer up to our small-batch rows
    assert len(calls) == 2 * sum(model.weights.layers[0].qkv.runs_own_kernel(batch) for batch in (1, 3))
    assert calls
    for got, expected in zip(outputs[True], outputs[False]):
        assert torch.equal(got, expected)
