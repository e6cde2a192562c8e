"""Linear: every path (compiled GEMV, oneDNN prepacked, F.linear) computes x @ w.T + b."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.engine.cpu_kernels import cpu_kernels
from distserve.engine import linear
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


@pytest.mark.parametrize("flags, float32_rows, bfloat16_rows", [
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, 16, 4),  # the register-tiled AVX-512 path for both
    ({"avx2", "fma", "avx512f"}, 16, 1),  # float32 tiled; bf16 through the portable loop
    ({"avx2", "fma"}, 16, 1),  # float32 tiled on AVX2
    ({"sse4_2"}, 1, 1),  # the portable loop only: it beats oneDNN at one row, not at two
])
def test_small_batch_rows_follow_the_cpu_the_kernel_was_built_for(monkeypatch, flags, float32_rows, bfloat16_rows):
    monkeypatch.setattr(linear, "cpu_flags", lambda: flags)
    assert linear.skinny_rows(torch.float32) == float32_rows
    assert linear.skinny_rows(torch.bfloat16) == bfloat16_rows
    assert linear.skinny_rows(torch.float16) == 0


def test_a_bf16_weight_is_packed_only_where_onednn_has_a_bf16_kernel(monkeypatch):
    """Packing a bf16 weight raises on a CPU without AVX512-BW/VL/DQ or AVX-NE-CONVERT (AVX2 only)."""
    weight = torch.randn(8, 16).bfloat16()
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert not linear._can_prepack(weight)
    assert linear._can_prepack(weight.float()) == torch.backends.mkldnn.is_available()
    got = Linear(weight)(torch.ones(64, 16).bfloat16())  # 64 rows: past our kernel, F.linear
    torch.testing.assert_close(got.float(), F.linear(torch.ones(64, 16), weight.float()), atol=5e-2, rtol=5e-2)
