"""The compiled sampler weights (csrc/sampling_weights.cpp) against the torch definition in sampling.py."""

from __future__ import annotations

import math

import pytest
import torch

from distserve.engine import sampling
from distserve.engine.sampling import SampleRow, sample_token
from distserve.request_types import SamplingParams
from tests.kernel_support import compiled_op


def kernel_or_torch_path():
    """The kernel where this CPU has AVX-512 or AVX2 + FMA; else None, once the sampler is seen to keep torch's ops."""
    op = compiled_op("sampling_weights_f32")
    if op is None:
        assert sampling.cpu_kernels_with(torch.zeros(1, 8), "sampling_weights_f32") is None
    return op


def reference(src: torch.Tensor, rows: list[int], scales: list[float], block: int):
    """sampling._weights over the chosen rows scaled, and its block sums with the kernel's block size."""
    scaled = src[rows] * torch.tensor(scales)[:, None]
    weights = scaled.sub(scaled.amax(-1, keepdim=True)).exp()
    vocab = src.shape[1]
    sums = [weights[:, k:k + block].sum(-1, dtype=torch.float64) for k in range(0, vocab, block)]
    return weights, torch.stack(sums, -1)


@pytest.mark.parametrize("vocab,block", [(32000, 256), (1003, 256), (7, 256), (300, 16)])
def test_weights_and_block_sums_match_the_torch_definition(vocab, block):
    gen = torch.Generator().manual_seed(vocab)
    src = torch.randn(6, vocab, generator=gen) * 4
    src[1, ::3] = float("-inf")  # filtered tokens
    rows, scales = [4, 1, 0, 1], [1.0, 0.5, 1.7, 2.0]
    if (kernel := kernel_or_torch_path()) is None:
        return
    weights, sums = kernel(src, torch.tensor(rows), torch.tensor(scales), block)
    expected_weights, expected_sums = reference(src, rows, scales, block)
    assert weights.shape == (4, vocab) and sums.shape == (4, math.ceil(vocab / block))
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sums, expected_sums, rtol=3e-6, atol=1e-9)  # exp approximations differ by ~2e-7
    assert (weights[1, ::3] == 0).all(), "a -inf logit must weigh exactly 0"
    assert (weights.amax(-1) == 1).all(), "the top token weighs exactly 1"


def test_non_finite_rows_get_nan_sums_and_leave_the_others_alone():
    src = torch.randn(5, 1000)
    src[0, 17] = float("nan")
    src[1, 3] = float("inf")
    src[2] = float("-inf")
    if (kernel := kernel_or_torch_path()) is None:
        return
    weights, sums = kernel(src, torch.arange(5), torch.ones(5), 256)
    assert sums[:3].isnan().all()
    assert sums[3:].isfinite().all()
    torch.testing.assert_close(weights[3:], reference(src, [3, 4], [1.0, 1.0], 256)[0], rtol=1e-6, atol=1e-7)


def test_bad_arguments_are_refused():
    if (kernel := kernel_or_torch_path()) is None:
        return
    with pytest.raises(RuntimeError, match="row out of range"):
        kernel(torch.zeros(2, 8), torch.tensor([2]), torch.ones(1), 4)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.zeros(2, 8, dtype=torch.bfloat16), torch.tensor([0]), torch.ones(1), 4)


def test_plain_and_filtered_rows_draw_alone_what_they_draw_together():
    """Plain rows go through the kernel from the logits, filtered or penalised ones through _scaled
    first: a row's token still depends on its own logits and parameters only."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5000, generator=gen) * 3
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, top_k=50, seed=2),
              SamplingParams(temperature=1.3, min_p=0.05, seed=3),
              SamplingParams(temperature=0.9, repetition_penalty=1.3, seed=4)]
    outputs = [[5, 9], [], [1], [7, 7, 2]]
    for index in range(5):
        rows = [SampleRow(p, index, (), (11, 12), out) for p, out in zip(params, outputs)]
        together = sampling.sample_tokens(logits, rows)
        alone = [sample_token(logits[b], p, index, [], (11, 12), out)
                 for b, (p, out) in enumerate(zip(params, outputs))]
        assert together == alone, index


def test_the_kernel_path_draws_from_the_same_distribution_as_the_torch_path():
    """Same weights up to float rounding: over many draws of one row, both paths' token counts agree."""
    logits = torch.tensor([2.0, 1.0, 0.5, float("-inf"), 0.0, -1.0] * 50)
    params = SamplingParams(temperature=0.8, seed=7)
    rows = [SampleRow(params, index) for index in range(3000)]
    batch = logits.expand(len(rows), -1)
    with_kernel = sampling.sample_tokens(batch, rows)
    order, weights, sums = sampling._sampled_weights(batch, rows, list(range(len(rows))), {})
    assert order == list(range(len(rows)))
    torch_weights, torch_sums = sampling._weights(sampling._scaled(batch, rows, list(range(len(rows))), {}))
    torch.testing.assert_close(weights, torch_weights, rtol=1e-6, atol=1e-7)
    uniforms = [sampling._uniform(7, index) for index in range(len(rows))]
    with_torch = sampling._draw(torch_weights, torch_sums, uniforms)
    differing = sum(a != b for a, b in zip(with_kernel, with_torch))
    assert differing <= 3, f"{differing} of 3000 draws differ: more than rounding at bucket edges explains"
    assert all(token % 6 != 3 for token in with_kernel), "a -inf token was drawn"


def test_without_the_kernel_sampling_takes_the_torch_path_to_the_same_draws(monkeypatch):
    """Where the kernel is not built (neither AVX-512 nor AVX2, DISTSERVE_CPU_KERNELS=0), the torch path serves."""
    logits = torch.tensor([2.0, 1.0, 0.5, float("-inf"), 0.0, -1.0] * 50)
    rows = [SampleRow(SamplingParams(temperature=0.8, seed=7), index) for index in range(2000)]
    batch = logits.expand(len(rows), -1)
    with_kernel = sampling.sample_tokens(batch, rows)
    monkeypatch.setattr(sampling, "cpu_kernels_with", lambda like, name: None)
    order, weights, _ = sampling._sampled_weights(batch, rows, list(range(len(rows))), {})
    assert order == list(range(len(rows))) and weights.shape == batch.shape
    without = sampling.sample_tokens(batch, rows)
    assert sum(a != b for a, b in zip(with_kernel, without)) <= 2
    assert all(token % 6 != 3 for token in without), "a -inf token was drawn"
