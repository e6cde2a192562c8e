"""The fused small-op kernels (silu*up, residual add + RMSNorm, RoPE) against torch. bfloat16's are built
where the CPU has AVX512-BF16 (elsewhere a bf16 model keeps torch's ops, the reference); float32's
everywhere (plain loops, csrc/small_ops_f32.cpp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.engine import model
from distserve.engine.model import apply_rope, rms_norm
from tests.kernel_support import compiled_op


@pytest.mark.parametrize("rows, width", [(1, 1408), (7, 1409), (64, 16)])
def test_fused_silu_and_mul_equals_torch(rows, width):
    silu_and_mul = compiled_op("silu_and_mul_bf16")
    if silu_and_mul is None:  # a bf16 model then runs torch's silu and mul
        assert model._fused_silu_and_mul("silu", torch.empty(1, dtype=torch.bfloat16)) is None
        return
    generator = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * width, generator=generator) * 4).bfloat16()
    gate, up = x.float().chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x).float(), F.silu(gate) * up, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_add_rms_norm_equals_the_transformers_formula(rows):
    """The sum is torch's bf16 add bit for bit and the norm is LlamaRMSNorm's (float32 normalise, bf16
    round, times the weight); without a delta it only normalises."""
    add_rms_norm = compiled_op("add_rms_norm_bf16")
    if add_rms_norm is None:  # a bf16 model then runs transformers' formula in torch ops
        assert model._fused_norm_rope(torch.empty(1, dtype=torch.bfloat16), 512, 64) is None
        return
    generator = torch.Generator().manual_seed(rows)
    residual, delta = (torch.randn(rows, 512, generator=generator).bfloat16() for _ in range(2))
    weight = (torch.rand(512, generator=generator) + 0.5).bfloat16()
    total, normed = add_rms_norm(residual, delta, weight, 1e-6)
    assert torch.equal(total, residual + delta)
    torch.testing.assert_close(normed, rms_norm(residual + delta, weight, 1e-6), atol=1e-2, rtol=1e-2)
    _, alone = add_rms_norm(residual, None, weight, 1e-6)
    torch.testing.assert_close(alone, rms_norm(residual, weight, 1e-6), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows, head_dim", [(1, 64), (9, 64), (5, 128)])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(rows, head_dim):
    rope = compiled_op("rope_bf16_")
    if rope is None:  # a bf16 model then runs apply_rope in torch ops
        assert model._fused_norm_rope(torch.empty(1, dtype=torch.bfloat16), 512, head_dim) is None
        return
    generator = torch.Generator().manual_seed(rows)
    heads, kv_heads = 4, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16()
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 6.28
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).bfloat16() for f in (torch.cos, torch.sin))  # halves duplicated
    before = qkv.clone()
    rotated = apply_rope(before[:, :(heads + kv_heads) * head_dim].float().view(rows, -1, head_dim),
                         cos.float()[:, None], sin.float()[:, None])
    rope(qkv, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(qkv[:, :(heads + kv_heads) * head_dim].float().view(rows, -1, head_dim), rotated,
                               atol=2e-2, rtol=2e-2)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])


@pytest.mark.parametrize("rows, width", [(1, 1408), (7, 1409), (64, 16), (3, 5)])
def test_float32_silu_and_mul_equals_torch(rows, width):
    silu_and_mul = compiled_op("silu_and_mul_f32")
    assert model._fused_silu_and_mul("silu", torch.empty(1)) == silu_and_mul
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * width, generator=generator) * 6
    x[0, 0], x[0, 1] = -100.0, 100.0  # exp's clamp, and a gate far past it
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows, width", [(1, 512), (7, 512), (64, 24), (2, 5)])
def test_float32_add_rms_norm_equals_the_transformers_formula(rows, width):
    add_rms_norm = compiled_op("add_rms_norm_f32")
    generator = torch.Generator().manual_seed(rows)
    residual, delta = (torch.randn(rows, width, generator=generator) for _ in range(2))
    weight = torch.rand(width, generator=generator) + 0.5
    total, normed = add_rms_norm(residual, delta, weight, 1e-6)
    assert torch.equal(total, residual + delta)
    torch.testing.assert_close(normed, rms_norm(residual + delta, weight, 1e-6), atol=1e-6, rtol=1e-5)
    total, alone = add_rms_norm(residual, None, weight, 1e-6)
    assert total is residual or torch.equal(total, residual)
    torch.testing.assert_close(alone, rms_norm(residual, weight, 1e-6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("rows, head_dim", [(1, 64), (9, 64), (5, 128), (3, 6)])
def test_float32_rope_rotates_q_and_k_in_place_and_leaves_v(rows, head_dim):
    rope = compiled_op("rope_f32_")
    assert model._fused_norm_rope(torch.empty(1), 512, head_dim).rope_ == rope
    generator = torch.Generator().manual_seed(rows)
    heads, kv_heads = 4, 2
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)
    angles = torch.rand(rows, head_dim // 2, generator=generator) * 6.28
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1) for f in (torch.cos, torch.sin))
    before = qkv.clone()
    rotated = apply_rope(before[:, :(heads + kv_heads) * head_dim].view(rows, -1, head_dim), cos[:, None], sin[:, None])
    rope(qkv, cos, sin, heads + kv_heads, head_dim)
    torch.testing.assert_close(qkv[:, :(heads + kv_heads) * head_dim].view(rows, -1, head_dim), rotated,
                               atol=1e-6, rtol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], before[:, (heads + kv_heads) * head_dim:])


def test_float32_fused_ops_refuse_other_dtypes_and_shapes():
    with pytest.raises(RuntimeError, match="float32"):
        compiled_op("silu_and_mul_f32")(torch.zeros(2, 4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="weight"):
        compiled_op("add_rms_norm_f32")(torch.zeros(2, 8), None, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="cos, sin"):
        compiled_op("rope_f32_")(torch.zeros(2, 64), torch.zeros(2, 8), torch.zeros(2, 16), 4, 16)
