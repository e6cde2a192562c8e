"""The fused small-op kernels of bfloat16 layers (silu*up, residual add + RMSNorm, RoPE) against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.engine.cpu_kernels import cpu_kernels
from distserve.engine.model import apply_rope, rms_norm


@pytest.mark.parametrize("rows, width", [(1, 1408), (7, 1409), (64, 16)])
def test_fused_silu_and_mul_equals_torch(rows, width):
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * width, generator=generator) * 4).bfloat16()
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul_bf16(x).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm_equals_the_transformers_formula(rows):
    """The sum is torch's bf16 add bit for bit and the norm is LlamaRMSNorm's (float32 normalise, bf16
    round, times the weight); without a delta it only normalises."""
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(rows)
    residual, delta = (torch.randn(rows, 512, generator=generator).bfloat16() for _ in range(2))
    weight = (torch.rand(512, generator=generator) + 0.5).bfloat16()
    total, normed = kernels.add_rms_norm_bf16(residual, delta, weight, 1e-6)
    assert torch.equal(total, residual + delta)
    torch.testing.assert_close(normed, rms_norm(residual + delta, weight, 1e-6), atol=1e-2, rtol=1e-2)
    _, alone = kernels.add_rms_norm_bf16(residual, None, weight, 1e-6)
    torch.testing.assert_close(alone, rms_norm(residual, weight, 1e-6), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows, head_dim", [(1, 64), (9, 64), (5, 128)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(rows, head_dim):
    kernels = cpu_kernels()
    generator = torch.Generator().manual_seed(rows)
    heads, kv_heads = 4, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16()
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 6.28
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).bfloat16() for f in (torch.cos, torch.sin))  # halves duplicated
    before = qkv.clone()
    rotated = apply_rope(before[:, :(heads + kv_heads) * head_dim].float().view(rows, -1, head_dim),
                         cos.float()[:, None], sin.float()[:, None])
    kernels.rope_bf16_(qkv, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(qkv[:, :(heads + kv_heads) * head_dim].float().view(rows, -1, head_dim), rotated,
                               atol=2e-2, rtol=2e-2)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])
