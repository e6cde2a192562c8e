"""The fused silu(gate) * up kernel for bfloat16 MLPs, against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.engine.cpu_kernels import cpu_kernels


@pytest.mark.parametrize("rows, width", [(1, 1408), (7, 1409), (64, 16)])
def test_fused_silu_and_mul_equals_torch(rows, width):
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * width, generator=generator) * 4).bfloat16()
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul_bf16(x).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)
