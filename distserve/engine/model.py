"""Our own forward pass for Llama-family decoders (Llama, Mistral, Qwen2), in two shapes:

- `prefill`: a packed batch of prompt chunks, no padding tokens. Each chunk's K/V is written once,
  straight into its prompt's contiguous KV buffer [L, 2, T, Hkv, D] (the layout that is sent), and
  its attention reads that buffer, so a prompt can be prefilled in several chunks. The last layer
  carries only the rows whose logits are wanted past its K/V (for a whole prompt, its last token).
- `decode`: one token per sequence. Each new token's K/V is written in place into the paged cache;
  attention reads the cache layer by layer through the block tables (`paged_attention`).

Maths follows transformers' modeling code (RMSNorm in float32, rotate-half RoPE, SDPA with scale
1/sqrt(D)), so float32 output matches `generate(do_sample=False)` token for token. On CPU the small
ops (add + RMSNorm, RoPE, silu*up; float32 on any CPU, bfloat16 with AVX512-BF16) and attention run
through our kernels (csrc/), within rounding of torch's ops. A decode-only step at small batch runs
each layer as one C++ call of the same ops (csrc/decode_layer.cpp), bitwise equal to the Python
layer. The same code runs on CUDA, with torch's ops.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from distserve.engine.attention import PagedDecodeAttention, compiled_decode_kernel, prefill_attention
from distserve.engine.cpu_kernels import cpu_kernels_with
from distserve.engine.kv_cache import PagedKvCache
from distserve.model_spec import text_config
from distserve.engine.weights import LayerWeights, ModelArgs, ModelWeights


@dataclasses.dataclass
class PrefillChunk:
    """A run of consecutive prompt tokens in a packed prefill batch."""

    start: int  # where the chunk's tokens begin in the packed batch
    length: int  # tokens in the chunk
    position: int  # the first token's position in its prompt (tokens before it are already in kv)
    kv: torch.Tensor  # the prompt's KV buffer [L, 2, T_prompt, Hkv, D]; this chunk fills [position, position+length)
    # attention masks built for this chunk, by (first query position, window): every layer reuses them
    masks: dict = dataclasses.field(default_factory=dict)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' LlamaRMSNorm: normalise in float32, scale in the input dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos, sin: [N, 1, D] (halves duplicated, as transformers' rotate_half expects)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(config, max_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for positions [0, max_positions): [P, D] each, computed exactly as transformers does."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(text_config(config))
    positions = torch.arange(max_positions)[None]  # [1, P]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D] float32
    return cos[0].to(device=device, dtype=dtype), sin[0].to(device=device, dtype=dtype)


class LlamaModel:
    """Weights plus forward; stateless between calls (all KV lives in buffers the caller owns)."""

    def __init__(self, args: ModelArgs, weights: ModelWeights, cos: torch.Tensor, sin: torch.Tensor):
        self.args = args
        self.weights = weights
        self.cos, self.sin = cos, sin  # [P, D]
        self.act = _activation(args.hidden_act)
        self.fused_silu_mul = _fused_silu_and_mul(args.hidden_act, weights.embed)
        self.fused_small_ops = _fused_norm_rope(weights.embed, args.hidden_size, args.head_dim)
        self.compiled_decode_layer = _compiled_decode_layer(self)

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.embed.dtype

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """x: [N, hidden] -> q [N, H, D], k [N, Hkv, D], v [N, Hkv, D] with RoPE applied to q and k.
        rope: this step's cos, sin rows [N, D]."""
        a = self.args
        qkv = layer.qkv(x)  # [N, (H + 2 Hkv) D]
        if self.fused_small_ops is not None:  # q and k rotated in place, in qkv
            self.fused_small_ops.rope_(qkv, rope[0], rope[1], a.num_heads + a.num_kv_heads, a.head_dim)
        q, k, v = qkv.split([a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim,
                             a.num_kv_heads * a.head_dim], dim=-1)
        q, k = q.view(-1, a.num_heads, a.head_dim), k.view(-1, a.num_kv_heads, a.head_dim)
        if self.fused_small_ops is None:
            cos, sin = rope[0].unsqueeze(1), rope[1].unsqueeze(1)  # [N, 1, D]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v.view(-1, a.num_kv_heads, a.head_dim)

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = layer.gate_up(x)  # [N, 2I]
        if self.fused_silu_mul is not None:
            return layer.down(self.fused_silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)  # [N, I] each
        return layer.down(self.act(gate) * up)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused_small_ops is not None:
            return self.fused_small_ops.add_rms_norm(x, None, weight, self.args.rms_norm_eps)[1]
        return rms_norm(x, weight, self.args.rms_norm_eps)

    def _add_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor):
        """(residual + delta, its RMSNorm with weight): one fused pass on CPU."""
        if self.fused_small_ops is not None:
            return self.fused_small_ops.add_rms_norm(residual, delta, weight, self.args.rms_norm_eps)
        h = residual + delta
        return h, rms_norm(h, weight, self.args.rms_norm_eps)

    def _layer(self, layer: LayerWeights, h: torch.Tensor, normed: torch.Tensor, attend, next_norm: torch.Tensor):
        """One decoder layer on h [N, hidden], whose input norm `normed` the previous layer computed;
        attend(x) is the attention block's output [N, H * D]. Returns (h out, h out normed with
        next_norm: the next layer's input norm, or the final norm)."""
        h, normed = self._add_norm(h, layer.o(attend(normed)), layer.post_attention_norm)
        return self._add_norm(h, self._mlp(layer, normed), next_norm)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, chunks: list[PrefillChunk],
                paged: "PagedStep | None", logits_rows: list[int] | slice) -> torch.Tensor:
        """One step over a packed batch: prompt chunks in rows [0, P), then (when `paged` is given) one
        token per decoding sequence in rows [P, N). Every row goes through the same weight matmuls,
        so the decode rows ride along on the prompt chunks' weight reads (chunked prefill, as vLLM and
        Sarathi do); only attention differs per kind of row.

        input_ids, positions: [N] (on the model's device); chunks cover [0, P) in order.
        Returns float32 logits [len(logits_rows), V] at the packed rows asked for; no other row's
        logits are computed, and past its K/V the last layer runs only those rows (`last_layer_rows`).
        """
        num_prefill = sum(c.length for c in chunks)
        layers = self.weights.layers
        rope = self.cos[positions], self.sin[positions]  # [N, D] each, shared by every layer
        h = self.weights.embed[input_ids]  # [N, hidden]
        normed = self._norm(h, layers[0].input_norm)
        compiled = (paged is not None and not chunks and self.compiled_decode_layer is not None
                    and layers[0].qkv.runs_own_kernel(len(input_ids)))
        last = last_layer_rows(chunks, len(input_ids), logits_rows)

        def attend(x, i, layer, queries=None):
            q, k, v = self._qkv(layer, x, rope)
            parts = []
            if chunks:
                parts.append(prefill_attention(q[:num_prefill], k[:num_prefill], v[:num_prefill], chunks, i,
                                               self.args.sliding_window, queries))
            if paged is not None:
                paged.cache.write_slots(i, paged.slots, k[num_prefill:], v[num_prefill:])
                parts.append(paged.attention(q[num_prefill:], paged.cache.layer(i)))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else self.weights.norm
            if compiled:  # the same maths as below, without a Python call per op
                h, normed = self._compiled_layer(i, layer, h, normed, rope, paged, next_norm)
            elif last is not None and i == len(layers) - 1:
                if not last.logits_rows:  # no row wants logits: the last layer only stores its K/V
                    attend(normed, i, layer, last.queries)
                    return torch.empty((0, self.args.vocab_size), dtype=torch.float32, device=self.device)
                h, normed = self._layer(layer, h[last.keep], normed,
                                        lambda x, i=i, layer=layer: attend(x, i, layer, last.queries), next_norm)
                logits_rows = last.logits_rows
            else:
                h, normed = self._layer(layer, h, normed, lambda x, i=i, layer=layer: attend(x, i, layer), next_norm)
        return self.weights.lm_head(normed[logits_rows]).float()  # float32 logits [len(logits_rows), V]

    def _compiled_layer(self, i: int, layer: LayerWeights, h: torch.Tensor, normed: torch.Tensor,
                        rope: tuple[torch.Tensor, torch.Tensor], paged: "PagedStep", next_norm: torch.Tensor):
        """`_layer` for a decode-only step, as one call of csrc/decode_layer.cpp."""
        a, attention = self.args, paged.attention
        return self.compiled_decode_layer(
            h, normed, layer.qkv.weight, layer.qkv.bias, layer.o.weight, layer.gate_up.weight, layer.down.weight,
            layer.post_attention_norm, next_norm, rope[0], rope[1], paged.cache.layer(i), paged.slots,
            attention.block_tables, attention.seq_lens, a.num_heads, a.num_kv_heads, attention.window or 0,
            a.head_dim ** -0.5, a.rms_norm_eps)

    def prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, chunks: list[PrefillChunk],
                logits_rows: list[int]) -> torch.Tensor:
        """A packed batch of prompt chunks only (see `forward`)."""
        return self.forward(input_ids, positions, chunks, None, logits_rows)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKvCache,
               block_tables: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One step: token input_ids[b] at positions[b] for every sequence b.

        block_tables: [B, max_blocks] (padded with the cache's pad block); slots: [B], where each
        new token's K/V goes. Every sequence attends to positions [0, positions[b]].
        Returns float32 logits [B, V].
        """
        paged = PagedStep(cache, block_tables, positions, slots, self.args.sliding_window)
        return self.forward(input_ids, positions, [], paged, slice(None))


@dataclasses.dataclass
class LastLayerRows:
    """The rows the last layer carries past its K/V: only rows whose logits are wanted matter there,
    as no later layer reads the others' hidden states (their K/V is still stored). For a prompt whose
    last row alone wants logits this skips the last layer's attention, o-proj and MLP for the rest of
    its rows: ~1/num_layers of a prefill's matmuls."""

    queries: list[int]  # per chunk: how many of its trailing rows are kept (see prefill_attention)
    keep: torch.Tensor  # [K] packed row indices kept: each chunk's trailing rows, then every decode row
    logits_rows: list[int]  # the asked-for logits rows, renumbered as indices into keep


def last_layer_rows(chunks: list[PrefillChunk], num_rows: int, logits_rows: list[int] | slice) -> LastLayerRows | None:
    """The last layer's kept rows for a step whose prompt rows are `chunks` (rows [0, P)) and decode
    rows [P, num_rows); None where every row is kept anyway (a decode-only step, all logits wanted)."""
    if not chunks or isinstance(logits_rows, slice):
        return None
    num_prefill = sum(c.length for c in chunks)
    first_wanted = {}  # chunk index -> its first row that wants logits
    starts = [c.start for c in chunks]
    for row in logits_rows:
        if row < num_prefill:
            index = bisect.bisect_right(starts, row) - 1
            first_wanted[index] = min(row, first_wanted.get(index, row))
    queries, keep = [], []
    for index, chunk in enumerate(chunks):
        end = chunk.start + chunk.length
        first = first_wanted.get(index, end)
        queries.append(end - first)
        keep += range(first, end)
    keep += range(num_prefill, num_rows)
    if len(keep) == num_rows:
        return None
    renumbered = {row: k for k, row in enumerate(keep)}
    return LastLayerRows(queries, torch.tensor(keep, dtype=torch.long, device=chunks[0].kv.device),
                         [renumbered[row] for row in logits_rows])


class PagedStep:
    """The decoding rows of a step: where their K/V goes in the paged cache and how they attend.

    block_tables: [B, max_blocks]; positions: [B], each new token's position; slots: [B].
    """

    def __init__(self, cache: PagedKvCache, block_tables: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, window: int | None):
        self.cache, self.slots = cache, slots
        self.attention = PagedDecodeAttention(cache, block_tables, positions + 1, window)


@dataclasses.dataclass(frozen=True)
class SmallOps:
    """The fused add + RMSNorm and in-place RoPE of one dtype (csrc/norm_rope.cpp for bfloat16,
    csrc/small_ops_f32.cpp for float32): see those files for the contracts."""

    add_rms_norm: Callable  # (residual, delta or None, weight, eps) -> (sum, normed)
    rope_: Callable  # (qkv, cos, sin, rotated_heads, head_dim), in place


def _fused_norm_rope(like: torch.Tensor, hidden_size: int, head_dim: int) -> SmallOps | None:
    """The fused small ops for the model's dtype on CPU, else None (torch's ops): bfloat16 on a CPU with
    AVX512-BF16 and sizes its kernels take; float32 on any CPU (plain vectorised loops)."""
    if like.dtype == torch.bfloat16 and not (hidden_size % 16 or head_dim % 32):
        kernels = cpu_kernels_with(like, "add_rms_norm_bf16")
        return SmallOps(kernels.add_rms_norm_bf16, kernels.rope_bf16_) if kernels is not None else None
    if like.dtype == torch.float32 and head_dim % 2 == 0:
        kernels = cpu_kernels_with(like, "add_rms_norm_f32")
        return SmallOps(kernels.add_rms_norm_f32, kernels.rope_f32_) if kernels is not None else None
    return None


_SILU_AND_MUL_OPS = {torch.bfloat16: "silu_and_mul_bf16", torch.float32: "silu_and_mul_f32"}


def _fused_silu_and_mul(act_name: str, like: torch.Tensor):
    """Our one-pass silu(gate) * up (csrc/silu_and_mul.cpp for bfloat16 on a CPU with AVX512-BF16,
    csrc/small_ops_f32.cpp for float32), else None."""
    name = _SILU_AND_MUL_OPS.get(like.dtype)
    kernels = cpu_kernels_with(like, name) if name and act_name in ("silu", "swish") else None
    return getattr(kernels, name) if kernels is not None else None


def _compiled_decode_layer(model: LlamaModel):
    """torch.ops.distserve.decode_layer (csrc/decode_layer.cpp) where it runs exactly this model's
    maths: on CPU, a silu MLP, no bias but qkv's, our tiled decode attention for the dtype and
    head_dim, and the fused small ops; else None (the Python layer)."""
    w, args = model.weights, model.args
    if args.hidden_act not in ("silu", "swish") or w.embed.dtype not in (torch.bfloat16, torch.float32):
        return None
    if any(linear.bias is not None for layer in w.layers for linear in (layer.o, layer.gate_up, layer.down)):
        return None
    if model.fused_small_ops is None or model.fused_silu_mul is None:
        return None
    if compiled_decode_kernel(torch.empty((0, args.head_dim), dtype=w.embed.dtype, device=w.embed.device)) is None:
        return None
    kernels = cpu_kernels_with(w.embed, "decode_layer")
    return kernels.decode_layer if kernels is not None else None


def _activation(name: str):
    if name not in ("silu", "swish"):
        from transformers.activations import ACT2FN

        return ACT2FN[name]
    return F.silu
