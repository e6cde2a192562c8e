"""Linear layers with weights prepared once for the device's fastest matmul.

On CPU the weight is prepacked into oneDNN's blocked layout at load time. Measured on one core
(benchmarks/engine_roofline.py; README "Engine"): for the default model's shapes a prepacked matmul
is 1.3-2x faster than `F.linear` from batch 1 to 256 rows, in float32 and bfloat16 alike. Elsewhere
(CUDA, or a torch without oneDNN) it is plain `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _can_prepack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear:
    """y = x @ weight.T + bias for x: [N, in] -> [N, out]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.num_bytes = weight.numel() * weight.element_size()  # what one pass streams from memory
        self.bias = bias
        self.is_prepacked = _can_prepack(weight)
        # batch-size hint 1: the decode shape; prefill's larger batches run just as fast on it
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.is_prepacked else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
