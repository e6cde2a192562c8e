"""Attention for packed prefill chunks and for paged decode.

Decode kernel choice, measured on one core (docs/engine.md, "Kernels"): on CPU a compiled kernel that reads K/V
through the block tables in place (csrc/decode_attention_*.cpp on AVX-512, and in float32 on AVX2 +
FMA, for head_dim 64/128, else the generic csrc/paged_attention.cpp); elsewhere, or when it cannot be built, torch SDPA over a
per-layer gather of whole KV blocks (`paged_attention`), which runs unchanged on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distserve.engine.cpu_kernels import cpu_kernels, cpu_kernels_with
from distserve.engine.dtype import cpu_has_amx


def _window_mask(q_positions: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) mask: [Nq, num_keys], True where query i may see key j."""
    keys = torch.arange(num_keys, device=q_positions.device)
    allowed = keys[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= keys[None, :] > q_positions[:, None] - window
    return allowed


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks, layer: int,
                      window: int | None, queries: list[int] | None = None) -> torch.Tensor:
    """Attention for a packed batch of prompt chunks.

    q: [N, H, D]; k, v: [N, Hkv, D]. Each chunk's k/v are first stored into its prompt's KV buffer
    (chunk.kv[layer]: [2, T, Hkv, D]) at positions [chunk.position, +length); its queries then attend
    to the buffer's positions [0, position + length) causally. Returns [N, H * D].

    queries, if given, holds per chunk how many of its trailing rows want an output (0 to length):
    K/V are still stored for every row, and the result is [sum(queries), H * D], chunk by chunk.
    """
    counts = queries if queries is not None else [c.length for c in chunks]
    out = torch.empty((sum(counts), q.shape[1] * q.shape[2]), dtype=q.dtype, device=q.device)
    kernel = prefill_kernel(q)
    done = 0
    for chunk, count in zip(chunks, counts):
        end = chunk.position + chunk.length
        buffer = chunk.kv[layer]  # [2, T, Hkv, D]
        rows = slice(chunk.start, chunk.start + chunk.length)
        buffer[0, chunk.position:end] = k[rows]
        buffer[1, chunk.position:end] = v[rows]
        if count == 0:
            continue
        first = end - count  # the first query's position in the prompt
        query_rows = slice(chunk.start + chunk.length - count, chunk.start + chunk.length)
        out_rows = slice(done, done + count)
        done += count
        if kernel is not None:
            out[out_rows] = kernel(q[query_rows].contiguous(), buffer, first, window or 0, q.shape[-1] ** -0.5)
            continue
        qc = q[query_rows].transpose(0, 1).unsqueeze(0)  # [1, H, count, D]
        kc = buffer[0, :end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, end, D]
        vc = buffer[1, :end].transpose(0, 1).unsqueeze(0)
        if first == 0 and (window is None or end <= window):
            o = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=_chunk_mask(chunk, first, window, q.dtype),
                                               enable_gqa=True)
        out[out_rows] = o[0].transpose(0, 1).reshape(count, -1)  # [count, H * D]
    return out


def _chunk_mask(chunk, first: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [count, end] (0 where query i at position first + i may see key j, -inf
    elsewhere) for a chunk's queries from position `first`, built once per step: every layer reuses it.
    Additive in the model dtype rather than boolean: SDPA's CPU kernel then skips converting it per call
    (a 256-query chunk after 768 cached tokens, bf16: 2.75 -> 2.54 ms per layer; 2.93 built per call)."""
    key = (first, window)
    if key not in chunk.masks:
        end = chunk.position + chunk.length
        allowed = _window_mask(torch.arange(first, end, device=chunk.kv.device), end, window)
        chunk.masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=chunk.kv.device).masked_fill_(
            ~allowed, float("-inf"))
    return chunk.masks[key]


def prefill_kernel(q: torch.Tensor):
    """The compiled prefill attention the engine uses for q, or None (torch SDPA).

    bfloat16: ours where the CPU has AVX512-BF16 but no AMX. Without AMX ours is ~4x faster than SDPA's
    CPU flash kernel per layer at 256 tokens; with AMX, SDPA's GEMMs run on AMX tiles and whole
    prefills were faster through it (kernel_ab prefill_attention, one-pass kernel: 256 tokens 26.1 vs
    30.7 ms, 1024 118.7 vs 225.5). float32: ours where the CPU has AVX-512 or AVX2 + FMA; it sums in
    another order than SDPA (as the float32 decode kernel does), and greedy output stays token-exact
    with `generate`.
    """
    if q.dtype == torch.bfloat16:
        return None if cpu_has_amx() else compiled_prefill_kernel(q)
    return compiled_prefill_kernel(q)


_PREFILL_OPS = {torch.bfloat16: "prefill_attention_bf16", torch.float32: "prefill_attention_f32"}


def compiled_prefill_kernel(q: torch.Tensor):
    """Our compiled prefill attention for q's dtype, on a CPU with the instructions it is built with
    (AVX512-BF16 for bfloat16, csrc/prefill_attention.cpp; float32: AVX-512 there, or AVX2 + FMA,
    csrc/prefill_attention_avx2.cpp) and head_dim 64 or 128, else None."""
    name = _PREFILL_OPS.get(q.dtype)
    if name is None or q.shape[-1] not in (64, 128):
        return None
    kernels = cpu_kernels_with(q, name)
    return getattr(kernels, name) if kernels is not None else None


_DECODE_OPS = {torch.bfloat16: "paged_decode_attention_bf16", torch.float32: "paged_decode_attention_f32"}


def compiled_decode_kernel(layer_cache: torch.Tensor):
    """Our tiled paged decode attention for a CPU cache with head_dim 64 or 128, else None (the
    generic kernel): csrc/decode_attention_bf16.cpp for bfloat16 where the CPU has AVX512-BF16; for
    float32 csrc/decode_attention_f32.cpp where it has AVX-512, csrc/decode_attention_avx2.cpp where it
    has AVX2 + FMA only. Whole decode steps on one core, filled cache, scattered blocks (kernel_ab,
    AVX-512): batch 32 x 256 tokens 27% faster in bf16, 14% in float32; 8 x 2048 48% and 26%."""
    name = _DECODE_OPS.get(layer_cache.dtype)
    kernels = cpu_kernels_with(layer_cache, name) if name and layer_cache.shape[-1] in (64, 128) else None
    return getattr(kernels, name) if kernels is not None else None


def decode_mask(seq_lens: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[B, 1, 1, num_keys]: True where sequence b's query (at seq_lens[b] - 1) may see key j."""
    return _window_mask(seq_lens - 1, num_keys, window)[:, None, None, :]


def paged_attention(q: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                    mask: torch.Tensor, workspace: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against its paged KV.

    q: [B, H, D]; layer_cache: [2, num_blocks + 1, block_size, Hkv, D] (one layer of the cache);
    block_tables: [B, max_blocks], padded with the zero pad block; mask: decode_mask(...) for
    max_blocks * block_size keys. workspace, if given, receives the gathered blocks
    [2, B * max_blocks, block_size, Hkv, D]: reusing it across layers saves the page faults of a
    fresh allocation (the largest cost at batch 50). Returns [B, H * D].
    """
    batch, max_blocks = block_tables.shape
    _, _, block_size, kv_heads, head_dim = layer_cache.shape
    kv = torch.index_select(layer_cache, 1, block_tables.flatten(), out=workspace)
    kv = kv.view(2, batch, max_blocks * block_size, kv_heads, head_dim).transpose(2, 3)  # [2, B, Hkv, S, D]
    # The G = H / Hkv query heads sharing a KV head go in as G query rows: [B, Hkv, G, D]. Measured
    # faster on CPU than SDPA's enable_gqa for one query token, with the same result.
    grouped = q.view(batch, kv_heads, -1, head_dim)
    o = F.scaled_dot_product_attention(grouped, kv[0], kv[1], attn_mask=mask)  # [B, Hkv, G, D]
    return o.reshape(batch, -1)


def gather_workspace(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """A buffer for paged_attention's gather of block_tables' blocks from one layer."""
    _, _, block_size, kv_heads, head_dim = layer_cache.shape
    return torch.empty((2, block_tables.numel(), block_size, kv_heads, head_dim), dtype=layer_cache.dtype,
                       device=layer_cache.device)


class PagedDecodeAttention:
    """Decode attention for one step: built once per step, called once per layer.

    block_tables: [B, max_blocks] padded with the pad block; seq_lens: [B], keys per sequence
    (the new token included, its K/V already in the cache).
    """

    def __init__(self, cache, block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int | None):
        self.block_tables, self.seq_lens, self.window = block_tables, seq_lens, window
        self.kernels = cpu_kernels() if cache.device.type == "cpu" else None
        generic = self.kernels.paged_decode_attention if self.kernels is not None else None
        self.kernel = compiled_decode_kernel(cache.layer(0)) or generic
        if self.kernels is None:
            self.mask = decode_mask(seq_lens, block_tables.shape[1] * cache.block_size, window)
            self.workspace = gather_workspace(cache.layer(0), block_tables)

    def __call__(self, q: torch.Tensor, layer_cache: torch.Tensor) -> torch.Tensor:
        """q: [B, H, D]; layer_cache: one layer of the cache. Returns [B, H * D]."""
        if self.kernels is None:
            return paged_attention(q, layer_cache, self.block_tables, self.mask, self.workspace)
        out = self.kernel(q.contiguous(), layer_cache, self.block_tables, self.seq_lens, self.window or 0,
                          q.shape[-1] ** -0.5)
        return out.view(q.shape[0], -1)
