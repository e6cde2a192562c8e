"""The shape presets (issue 41): `qwen-0.5b-shape` and `llama-1b-shape` carry Qwen2.5-0.5B's and
Llama-3.2-1B's configs, and our engine gives transformers' greedy output at their width.

At full size a preset takes 30-45 s to build, and a float32 comparison holds two copies of its weights
(llama-1b-shape: 14 GB, ~90 s on 2 cores): too much for the unit suite. So these tests build each preset
at its full width (vocabulary, hidden size, heads, head dim 64, MLP, RoPE) with 2 of its layers, through
the same builder. That keeps every feature the shape exercises: GQA 7:1 and qkv bias (Qwen2), GQA 4:1
and llama3 RoPE scaling (Llama), rope theta 1e6 and 5e5, tied embeddings, a vocabulary past the
tokenizer's, a bfloat16 checkpoint loaded into float32. The full-size presets are for benchmarks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distserve.engine.default_model import PRESETS, build_model, preset_config
from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model_loader import load_engine_model, load_model
from distserve.engine.model_runner import ModelRunner
from distserve.engine.weights import ModelArgs
from distserve.model_spec import ModelSpec
from tests.builders import compare_with_tolerance, reference_generate, runner_greedy

SHAPES = ("qwen-0.5b-shape", "llama-1b-shape")
NUM_LAYERS = 2
NUM_NEW = 8
BLOCK_SIZE = 4
# Largest |ours - transformers| over the largest |logit|, float32: ~1e-6 measured. Plain RoPE in place of
# llama3's scaling gives ~6e-3 at these positions, theta 1e4 for 1e6 ~9e-2, the qkv bias dropped ~1.
LOGITS_BOUND = 1e-4

# (parameters, GQA ratio, max context): Qwen2.5-0.5B's 494M and Llama-3.2-1B's 1.24B, embeddings counted once
EXPECTED = {"qwen-0.5b-shape": (494_032_768, 7, 32768), "llama-1b-shape": (1_235_814_400, 4, 131072)}


@pytest.mark.parametrize("name", SHAPES)
def test_preset_config_is_the_real_models(name):
    """The config as the engine and the router read it, and the parameter count (built on the meta
    device: no memory) of the model it makes."""
    from transformers import AutoModelForCausalLM

    spec = PRESETS[name]
    config = preset_config(spec)
    args, model_spec = ModelArgs.from_config(config), ModelSpec.from_config(config)
    num_params, gqa, max_context = EXPECTED[name]
    assert args.model_type == spec.architecture
    assert args.head_dim == 64 and args.num_heads // args.num_kv_heads == gqa
    assert args.tie_word_embeddings and args.sliding_window is None
    assert model_spec.vocab_size == spec.vocab_size > spec.num_tokenizer_tokens == 32000
    assert model_spec.max_context == max_context
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == num_params


def test_llama_preset_has_llama3_rope_scaling():
    rope = preset_config(PRESETS["llama-1b-shape"]).rope_parameters
    assert rope == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert preset_config(PRESETS["qwen-0.5b-shape"]).rope_parameters["rope_theta"] == 1e6


def _perturb_biases_and_norms(model) -> None:
    """transformers' init leaves biases at zero and norm weights at one: moved off them (seeded), a q/k/v
    bias or a norm read into the wrong place changes the output."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif "norm" in name:
                param.copy_(1 + torch.randn(param.shape, generator=generator) * 0.1)


@pytest.fixture(scope="module", params=SHAPES)
def preset_models(request, tmp_path_factory):
    """(name, transformers' model, our runner), both float32, of the preset at full width and NUM_LAYERS
    layers, saved as the preset saves (bfloat16, tied) and loaded back."""
    spec = dataclasses.replace(PRESETS[request.param], num_layers=NUM_LAYERS)
    model = build_model(spec)
    _perturb_biases_and_norms(model)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    del model
    return request.param, load_model(str(folder), "float32", "cpu"), ModelRunner(
        load_engine_model(str(folder), "float32", "cpu"))


def test_greedy_output_equals_transformers_generate(preset_models):
    """float32 greedy through the engine's prefill and paged decode (at batch 1: the compiled decode layer
    where this CPU has it) equals `generate(do_sample=False)`, token for token."""
    name, reference_model, runner = preset_models
    weights = runner.model.weights
    assert weights.embed.dtype == torch.float32  # the bf16 checkpoint, upcast
    assert weights.lm_head.weight.data_ptr() == weights.embed.data_ptr()  # tied: one matrix
    assert (weights.layers[0].qkv.bias is not None) == (name == "qwen-0.5b-shape")
    vocab = PRESETS[name].vocab_size
    generator = torch.Generator().manual_seed(41)
    for length in (5, 33):  # ids from the whole vocabulary, past the tokenizer's 32000 included
        prompt = torch.randint(3, vocab, (length,), generator=generator).tolist()
        matches, _ = compare_with_tolerance(runner_greedy(runner, prompt, NUM_NEW),
                                            reference_generate(reference_model, prompt, NUM_NEW))
        assert matches, (name, prompt)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def test_logits_equal_transformers_forward(preset_models):
    """Every logit, not only the argmax (a random tied model may repeat one token, whatever its RoPE):
    a prefill's last row, then decode steps on the paged cache, against transformers' forward."""
    name, reference_model, runner = preset_models
    a = runner.model.args
    generator = torch.Generator().manual_seed(42)
    tokens = torch.randint(3, a.vocab_size, (33,), generator=generator).tolist()
    fed = torch.randint(3, a.vocab_size, (3,), generator=generator).tolist()
    logits, (kv,) = runner.prefill([tokens])
    cache = PagedKvCache(a.num_layers, a.num_kv_heads, a.head_dim, 16, BLOCK_SIZE, torch.float32, "cpu")
    table = cache.allocator.allocate(blocks_needed(len(tokens) + len(fed), BLOCK_SIZE))
    cache.write_prompt(table, kv)
    for step, token in enumerate([None, *fed]):
        if token is not None:
            logits = runner.decode(cache, [table], [len(tokens)], [token])
            tokens.append(token)
        with torch.no_grad():
            expected = reference_model(torch.tensor([tokens])).logits[0, -1]
        assert _relative_error(logits[0], expected) < LOGITS_BOUND, (name, step)
