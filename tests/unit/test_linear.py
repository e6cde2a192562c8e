"""Linear: every path (compiled GEMV, oneDNN prepacked, F.linear) computes x @ w.T + b."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.engine.cpu_kernels import cpu_kernels
from distserve.engine.linear import Linear


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear_for_every_batch_size(dtype, tolerance, rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 40, generator=generator).to(dtype)  # odd sizes: no path may assume multiples
    bias = torch.randn(37, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, 40, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    got = Linear(weight, bias)(x)
    assert got.shape == (rows, 37) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 12, 13, 16, 17])
@pytest.mark.parametrize("out_features, in_features", [(300, 512), (37, 64), (64, 1408), (9, 40)])
def test_the_compiled_kernel_is_built_and_matches(dtype, tolerance, rows, out_features, in_features):
    """Every tile shape: rows beyond a pass of 4, weight rows not a multiple of the tile (the tail), and
    an in_features the vector loop cannot step through (40: the portable path)."""
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here (compiler and ninja are installed)"
    generator = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    expected = F.linear(x.float(), weight.float())
    scale = expected.abs().max()
    got = kernels.skinny_linear(x, weight)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float() / scale, expected / scale, atol=tolerance, rtol=0)
