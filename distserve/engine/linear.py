"""Linear layers with weights prepared for the device's fastest matmul, chosen per call by batch rows.

On CPU, measured on one core (benchmarks/engine_roofline.py, docs/engine.md):
- few rows (small-batch decode: up to 4 in bfloat16, 16 in float32; on AVX2, float32 up to 4, 16 for
  an lm_head): our compiled kernel (csrc/skinny_matmul.cpp: register-tiled AVX-512 or AVX2, bf16 dot
  products, software prefetch into L1 and L2) streams the weights faster than oneDNN there (whole decode steps, interleaved: batch 1 1.4x in
  bf16 and 1.7x in fp32, batch 4 1.03x in bf16, batch 16 1.2x in fp32);
- more rows (prefill, larger decode batches): the weight prepacked into oneDNN's blocked layout,
  1.3-2x faster than `F.linear` from 4 to 256 rows in float32 and bfloat16 (PACK_BATCH_HINT). It is packed
  on first use, so a worker that never runs batches holds no second copy.
Elsewhere (CUDA, or no compiler/oneDNN) it is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distserve.engine.cpu_kernels import AVX2_FMA, AVX512, AVX512_BF16, cpu_kernels
from distserve.engine.dtype import cpu_flags

# Most rows for which our kernel beats oneDNN (measured: benchmarks/engine_roofline.py,
# "linear_gbps_by_rows"): beyond them its per-row reductions and passes over the tile cost more than
# oneDNN's blocking saves.
SKINNY_ROWS = {torch.float32: 16, torch.bfloat16: 4}
# With AVX2 + FMA only (AMD Zen 2/3, older Xeons) the tiled path runs 8 float32 lanes and 2 rows a pass,
# up to as many rows as on AVX-512. One matmul alone, its weight hot in the L3, favours oneDNN from ~12
# rows (AMD EPYC, one core, medians of 30, ours / oneDNN: 2816x512 0.22 / 0.32 ms at 4 rows, 0.42 / 0.44
# at 8, 0.66 / 0.63 at 12), but in a decode step every weight streams from memory (default:small's
# 160 MB against a 32 MB L3), and there ours stays ahead: whole fp32 decode steps, 256 tokens of
# context, oneDNN / ours (kernel_ab decode_linear, interleaved): batch 6 23.3 / 14.1 ms, 8 25.1 / 17.7,
# 12 31.4 / 25.5, 16 40.3 / 33.8, 24 58.6 / 57.5, 32 62.9 / 62.6. (The limit was 4 rows for all but
# the lm_head, from the single-matmul numbers: steps at batch 6-16 ran 11-28% longer.)
AVX2_SKINNY_ROWS = 16
# Without either, a portable loop (one dot per row), faster than oneDNN at one row only (same box,
# 2816x512: 0.15 / 0.24 ms at 1 row, 0.37 / 0.23 at 2).
PORTABLE_SKINNY_ROWS = 1


def skinny_rows(dtype: torch.dtype) -> int:
    """Most rows a linear of this dtype runs through our kernel on this CPU (0: never)."""
    if dtype not in SKINNY_ROWS:
        return 0
    flags = cpu_flags()
    if (AVX512 if dtype == torch.float32 else AVX512_BF16) <= flags:
        return SKINNY_ROWS[dtype]
    if dtype == torch.float32 and AVX2_FMA <= flags:
        return AVX2_SKINNY_ROWS
    return PORTABLE_SKINNY_ROWS


# The batch size oneDNN is told to expect when it packs a weight: it picks the blocked layout by it.
# Measured on one core, Xeon with AMX: single matmuls of the default model at 4-256 rows were as fast
# or faster packed for 64 than for 1 (the bf16 lm_head at 50 rows 5.3 -> 3.4 ms); whole decode steps
# at batch 8-64 2-8% faster (kernel_ab linear_pack_hint); prefills unchanged within noise.
PACK_BATCH_HINT = 64


def _can_prepack(weight: torch.Tensor) -> bool:
    """oneDNN's packed layout, where it has a kernel for the dtype: its bf16 path needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT, and on a CPU with neither (AVX2 only) packing a bf16 weight raises."""
    if not (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return weight.dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x @ weight.T + bias for x: [N, in] -> [N, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.num_bytes = weight.numel() * weight.element_size()  # what one pass streams from memory
        self.weight = weight.contiguous()  # [out, in]
        self.bias = bias
        self._can_prepack = _can_prepack(weight)
        self._packed: torch.Tensor | None = None
        self._kernels = cpu_kernels() if weight.device.type == "cpu" else None
        self._skinny_rows = skinny_rows(weight.dtype)

    def runs_own_kernel(self, rows: int) -> bool:
        """Whether `rows` rows go through our compiled small-batch kernel (else oneDNN or F.linear)."""
        return self._kernels is not None and rows <= self._skinny_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.runs_own_kernel(x.shape[0]):
            y = self._kernels.skinny_linear(x, self.weight)
            return y if self.bias is None else y + self.bias
        if self._can_prepack:
            if self._packed is None:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACK_BATCH_HINT)
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
