"""Linear layers with weights prepared for the device's fastest matmul, chosen per call by batch rows.

On CPU, measured on one core (benchmarks/engine_roofline.py, README "Engine"):
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
# With AVX2 + FMA only (AMD Zen 2/3, older Xeons) the tiled path runs 8 float32 lanes and 2 rows a pass.
# AMD EPYC (AVX2), one core, medians of 30, ours / oneDNN: a 2816x512 weight 0.12 / 0.19 ms at 2 rows,
# 0.22 / 0.32 at 4, 0.42 / 0.44 at 8, 0.66 / 0.63 at 12; 512x1408 0.15 / 0.22 at 4, 0.33 / 0.29 at 8.
# A weight too big for the L3 (the lm_head, 32000x512: 65 MB) streams from memory at any batch, and
# there ours stays ahead further: 6.1 / 7.9 ms at 4 rows, 7.8 / 11.1 at 8, 12.2 / 15.3 at 16, 16.0 /
# 15.5 at 24.
AVX2_SKINNY_ROWS, AVX2_STREAMED_SKINNY_ROWS, AVX2_STREAMED_BYTES = 4, 16, 32 << 20
# Without either, a portable loop (one dot per row), faster than oneDNN at one row only (same box,
# 2816x512: 0.15 / 0.24 ms at 1 row, 0.37 / 0.23 at 2).
PORTABLE_SKINNY_ROWS = 1


def skinny_rows(dtype: torch.dtype, weight_bytes: int = 0) -> int:
    """Most rows a linear of this dtype (and weight size) runs through our kernel on this CPU (0: never)."""
    if dtype not in SKINNY_ROWS:
        return 0
    flags = cpu_flags()
    if (AVX512 if dtype == torch.float32 else AVX512_BF16) <= flags:
        return SKINNY_ROWS[dtype]
    if dtype == torch.float32 and AVX2_FMA <= flags:
        return AVX2_STREAMED_SKINNY_ROWS if weight_bytes > AVX2_STREAMED_BYTES else AVX2_SKINNY_ROWS
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
        self._skinny_rows = skinny_rows(weight.dtype, self.num_bytes)

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
