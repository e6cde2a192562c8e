"""Paged decode attention and chunked prefill attention against dense SDPA references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from distserve.engine.attention import PagedDecodeAttention, decode_mask, paged_attention, prefill_attention
from distserve.engine.cpu_kernels import cpu_kernels
from distserve.engine.kv_cache import PagedKvCache, blocks_needed
from distserve.engine.model import PrefillChunk
from tests.kernel_support import compiled_op

BLOCK_SIZE = 4


def dense_reference(q, k, v, window=None):
    """q: [H, 1, D] at the last of S positions; k, v: [Hkv, S, D] -> [H * D]."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    if window is not None:
        k, v = k[:, -window:], v[:, -window:]
    return F.scaled_dot_product_attention(q, k, v).reshape(-1)


def random_paged_batch(seed: int, dtype=torch.float32):
    """A cache with random sequences in random, interleaved blocks, their queries and dense K/V."""
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = [(4, 2, 8), (6, 6, 16), (8, 1, 4)][seed % 3]
    batch = int(torch.randint(1, 7, (1,), generator=generator))
    lengths = torch.randint(1, 40, (batch,), generator=generator).tolist()
    cache = PagedKvCache(1, kv_heads, head_dim, 64, BLOCK_SIZE, dtype, "cpu")
    free = torch.randperm(64, generator=generator).tolist()  # random, interleaved block tables
    tables, dense_k, dense_v = [], [], []
    for n in lengths:
        table = [free.pop() for _ in range(blocks_needed(n, BLOCK_SIZE))]
        k = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        cache.write_slots(0, cache._slots(table, n), k, v)
        tables.append(table)
        dense_k.append(k.transpose(0, 1))
        dense_v.append(v.transpose(0, 1))
    q = torch.randn(batch, heads, head_dim, generator=generator).to(dtype)
    return cache, tables, lengths, q, dense_k, dense_v


def assert_matches_dense(got, q, dense_k, dense_v, window, tolerance):
    for b in range(q.shape[0]):
        expected = dense_reference(q[b].unsqueeze(1).float(), dense_k[b].float(), dense_v[b].float(), window)
        torch.testing.assert_close(got[b].float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_equals_dense_sdpa_over_random_tables(seed, window):
    cache, tables, lengths, q, dense_k, dense_v = random_paged_batch(seed)
    block_tables = cache.block_table_tensor(tables, lengths)
    mask = decode_mask(torch.tensor(lengths), block_tables.shape[1] * BLOCK_SIZE, window)
    got = paged_attention(q, cache.layer(0), block_tables, mask)
    assert_matches_dense(got, q, dense_k, dense_v, window, 1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_compiled_cpu_kernel_equals_dense_sdpa_over_random_tables(seed, window, dtype, tolerance):
    assert cpu_kernels() is not None, "the CPU kernel must build here (compiler and ninja are installed)"
    cache, tables, lengths, q, dense_k, dense_v = random_paged_batch(seed, dtype)
    attention = PagedDecodeAttention(cache, cache.block_table_tensor(tables, lengths), torch.tensor(lengths), window)
    assert attention.kernels is not None
    assert_matches_dense(attention(q, cache.layer(0)), q, dense_k, dense_v, window, tolerance)


@pytest.mark.parametrize("window", [None, 6])
def test_chunked_prefill_attention_equals_one_causal_pass(window):
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, total = 4, 2, 8, 23
    q = torch.randn(total, heads, head_dim, generator=generator)
    k = torch.randn(total, kv_heads, head_dim, generator=generator)
    v = torch.randn(total, kv_heads, head_dim, generator=generator)
    whole_kv = torch.empty(1, 2, total, kv_heads, head_dim)
    whole = prefill_attention(q, k, v, [PrefillChunk(start=0, length=total, position=0, kv=whole_kv)],
                              0, window)
    chunked_kv = torch.empty_like(whole_kv)
    pieces = []
    for begin, end in [(0, 7), (7, 8), (8, 23)]:  # each chunk its own packed batch
        chunk = PrefillChunk(start=0, length=end - begin, position=begin, kv=chunked_kv)
        pieces.append(prefill_attention(q[begin:end], k[begin:end], v[begin:end], [chunk], 0, window))

    torch.testing.assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked_kv, whole_kv)
    mask = torch.ones(total, total).tril().bool()
    if window is not None:
        mask &= torch.ones(total, total).triu(-(window - 1)).bool()
    reference = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(2, 0), v.transpose(0, 1).repeat_interleave(2, 0),
        attn_mask=mask).transpose(0, 1).reshape(total, -1)
    torch.testing.assert_close(whole, reference, atol=1e-5, rtol=1e-5)


def test_packed_prompts_do_not_attend_to_each_other():
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(10, 2, 4, generator=generator)
    k = torch.randn(10, 2, 4, generator=generator)
    v = torch.randn(10, 2, 4, generator=generator)
    buffers = [torch.empty(1, 2, 3, 2, 4), torch.empty(1, 2, 7, 2, 4)]
    packed = prefill_attention(q, k, v, [PrefillChunk(start=0, length=3, position=0, kv=buffers[0]),
                                         PrefillChunk(start=3, length=7, position=0, kv=buffers[1])], 0, None)
    alone = prefill_attention(q[3:], k[3:], v[3:], [PrefillChunk(start=0, length=7, position=0,
                                                                         kv=torch.empty(1, 2, 7, 2, 4))], 0, None)
    torch.testing.assert_close(packed[3:], alone)


def _masked_reference(q, kv, position, window):
    """float32 SDPA for a chunk of q [n, H, D] at `position` against kv [2, T, Hkv, D] -> [n, H * D]."""
    n, end = q.shape[0], position + q.shape[0]
    q_positions, keys = torch.arange(position, end), torch.arange(end)
    mask = keys[None, :] <= q_positions[:, None]
    if window:
        mask &= keys[None, :] > q_positions[:, None] - window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], kv[0, :end].float().transpose(0, 1)[None],
                                         kv[1, :end].float().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(8, 4), (4, 4), (8, 1)])
@pytest.mark.parametrize("length, position, window", [
    (1, 0, 0), (5, 0, 0), (70, 0, 0), (37, 100, 0), (33, 20, 16), (100, 0, 30), (3, 50, 7), (301, 200, 0),
    (260, 0, 64)])
@pytest.mark.parametrize("op, dtype, tolerance", [("prefill_attention_bf16", torch.bfloat16, 2e-2),
                                                  ("prefill_attention_f32", torch.float32, 1e-5)])
def test_compiled_prefill_attention_equals_sdpa(head_dim, heads, kv_heads, length, position, window, op, dtype,
                                                tolerance):
    """Chunks at any position, sliding windows, GQA groups, and lengths that end mid query-block and
    mid key-block, against float32 SDPA (bf16: the output is rounded to bf16, and so is P in P V)."""
    kernel = compiled_op(op) or _sdpa_prefill_attention  # the engine's path without it
    generator = torch.Generator().manual_seed(length * 7 + position)
    q = torch.randn(length, heads, head_dim, generator=generator).to(dtype)
    kv = torch.randn(2, position + length + 3, kv_heads, head_dim, generator=generator).to(dtype)
    got = kernel(q, kv, position, window, head_dim ** -0.5)
    assert got.shape == (length, heads * head_dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), _masked_reference(q, kv, position, window), atol=tolerance, rtol=tolerance)


def _sdpa_prefill_attention(q, kv, position, window, scale):
    """prefill_attention's torch path (SDPA) for one chunk whose K/V are already in kv [2, T, Hkv, D]."""
    from distserve.engine.model import PrefillChunk

    assert scale == q.shape[-1] ** -0.5
    end = position + len(q)
    chunk = PrefillChunk(0, len(q), position, kv[None])
    return prefill_attention(q, kv[0, position:end], kv[1, position:end], [chunk], 0, window or None)


@pytest.mark.parametrize("amx", [False, True])
def test_prefill_uses_the_compiled_kernel_in_bf16_without_amx_and_in_float32(monkeypatch, amx):
    """bf16: ours where the CPU has AVX512-BF16 but no AMX; with AMX (its GEMMs run on AMX tiles) or
    without AVX512-BF16, SDPA. float32: ours wherever the CPU has AVX-512 or AVX2 + FMA."""
    from distserve.engine import attention

    monkeypatch.setattr(attention, "cpu_has_amx", lambda: amx)
    bf16 = torch.empty(1, 8, 64, dtype=torch.bfloat16)
    assert attention.prefill_kernel(bf16) == (compiled_op("prefill_attention_bf16") if not amx else None)
    assert attention.prefill_kernel(torch.empty(1, 8, 64)) == compiled_op("prefill_attention_f32")
    assert attention.prefill_kernel(torch.empty(1, 8, 16, dtype=torch.bfloat16)) is None  # unsupported head_dim
    assert attention.prefill_kernel(torch.empty(1, 8, 16)) is None



@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(8, 4), (4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 5, 20])
@pytest.mark.parametrize("op, dtype, tolerance", [("paged_decode_attention_bf16", torch.bfloat16, 2e-2),
                                                  ("paged_decode_attention_f32", torch.float32, 1e-5)])
def test_compiled_decode_attention_equals_dense_sdpa(head_dim, heads, kv_heads, window, op, dtype, tolerance):
    """Random interleaved block tables; lengths that end mid key-tile (1, 15, 17, 40) and on one (16, 32);
    GQA groups of 1, 2, 3 (odd: the single-head path) and 8; against float32 SDPA."""
    kernel = compiled_op(op) or cpu_kernels().paged_decode_attention  # the engine's kernel without it
    generator = torch.Generator().manual_seed(head_dim + heads * 10 + kv_heads + (window or 0))
    lengths = [1, 15, 16, 17, 32, 40]
    cache = PagedKvCache(1, kv_heads, head_dim, 64, BLOCK_SIZE, dtype, "cpu")
    free = torch.randperm(64, generator=generator).tolist()
    tables, dense_k, dense_v = [], [], []
    for n in lengths:
        table = [free.pop() for _ in range(blocks_needed(n, BLOCK_SIZE))]
        k = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=generator).to(dtype)
        cache.write_slots(0, cache._slots(table, n), k, v)
        tables.append(table)
        dense_k.append(k.transpose(0, 1))
        dense_v.append(v.transpose(0, 1))
    q = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
    got = kernel(q, cache.layer(0), cache.block_table_tensor(tables, lengths), torch.tensor(lengths),
                 window or 0, head_dim ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    assert_matches_dense(got.reshape(len(lengths), -1), q, dense_k, dense_v, window, tolerance)


@pytest.mark.parametrize("op, dtype", [("paged_decode_attention_bf16", torch.bfloat16),
                                       ("paged_decode_attention_f32", torch.float32)])
def test_compiled_decode_attention_refuses_a_sequence_without_keys(op, dtype):
    cache = PagedKvCache(1, 4, 64, 4, BLOCK_SIZE, dtype, "cpu")
    q = torch.zeros(2, 8, 64, dtype=dtype)
    tables = cache.block_table_tensor([[0], [1]], [3, 1])
    with pytest.raises(RuntimeError, match="at least one key"):
        (compiled_op(op) or cpu_kernels().paged_decode_attention)(q, cache.layer(0), tables, torch.tensor([3, 0]),
                                                                   0, 0.125)


def test_decode_uses_the_compiled_kernel_for_its_dtype_and_head_dim():
    from distserve.engine.attention import compiled_decode_kernel

    kernels = cpu_kernels()
    assert compiled_decode_kernel(torch.empty(2, 3, 16, 4, 64, dtype=torch.bfloat16)) == \
        compiled_op("paged_decode_attention_bf16")  # None where the CPU lacks AVX512-BF16: the generic kernel
    assert compiled_decode_kernel(torch.empty(2, 3, 16, 4, 128)) == compiled_op("paged_decode_attention_f32")
    assert compiled_decode_kernel(torch.empty(2, 3, 16, 4, 16, dtype=torch.bfloat16)) is None  # unsupported head_dim
    assert compiled_decode_kernel(torch.empty(2, 3, 16, 4, 64, dtype=torch.float16)) is None  # no float16 kernel
    for dtype in (torch.bfloat16, torch.float32):
        cache = PagedKvCache(1, 4, 64, 8, BLOCK_SIZE, dtype, "cpu")
        attention = PagedDecodeAttention(cache, cache.block_table_tensor([[0]], [1]), torch.tensor([1]), None)
        assert attention.kernel == (compiled_decode_kernel(cache.layer(0)) or kernels.paged_decode_attention)
    cache = PagedKvCache(1, 4, 16, 8, BLOCK_SIZE, torch.float32, "cpu")  # head_dim 16: the generic kernel
    attention = PagedDecodeAttention(cache, cache.block_table_tensor([[0]], [1]), torch.tensor([1]), None)
    assert attention.kernel == kernels.paged_decode_attention
