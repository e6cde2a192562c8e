"""A worker's paged KV cache sized from its GPU's memory (--gpu-memory-fraction), as vLLM's
gpu_memory_utilization: the worker may use that fraction of the device's total memory; what its model
weights already hold and a reserve for one forward's activations come off, the KV cache gets the rest.
Measured against total, not free, memory: workers sharing a GPU (each given its share by
distserve.gpu_placement) then size alike whatever order they start in. On CPU, or with fraction 0,
the configured kv_cache_mb stands.
"""

from __future__ import annotations

from typing import Callable

import torch

from distserve.config import ConfigError

MIB = 1024 * 1024
# Activations of one forward, per packed token: the residual stream, q/k/v, attention output and the MLP's
# gate/up/down rows in the model dtype, plus float32 logits for the rows that want them, doubled for the
# allocator's fragmentation. An estimate: the GPU check (scripts/gpu_check.sh) measures the real peak.
ACTIVATION_SLACK = 2


def activation_reserve_bytes(args, num_tokens: int, dtype_bytes: int) -> int:
    """What one forward of num_tokens packed rows may hold besides weights and KV, an estimate (`args`: the
    model's distserve.engine.weights.ModelArgs)."""
    per_token = (4 * args.hidden_size + 3 * args.intermediate_size) * dtype_bytes
    logits = min(num_tokens, 256) * args.vocab_size * 4  # the rows that want logits: a batch's prompts, or decode rows
    return ACTIVATION_SLACK * (num_tokens * per_token + logits)


def kv_cache_budget_mb(kv_cache_mb: int, device: str, memory_fraction: float, reserve: Callable[[], int],
                       memory: Callable[[], tuple[int, int]] | None = None) -> int:
    """The KV cache's MiB: kv_cache_mb on CPU or with memory_fraction 0; on CUDA, memory_fraction of the
    device's total memory less what this process holds already (`memory`: (total bytes, bytes this process
    holds), the current device's by default) and reserve() bytes. ConfigError naming gpu_memory_fraction
    when nothing is left."""
    if not device.startswith("cuda") or not memory_fraction:
        return kv_cache_mb
    total, held = (memory or (lambda: _device_memory(torch.device(device))))()
    reserve_bytes = reserve()
    budget = int(total * memory_fraction) - held - reserve_bytes
    if budget < MIB:
        raise ConfigError(f"gpu_memory_fraction: {memory_fraction} of {total / MIB:.0f} MiB leaves no room for a KV "
                          f"cache after the {held / MIB:.0f} MiB this worker holds and a "
                          f"{reserve_bytes / MIB:.0f} MiB activation reserve; raise it")
    return budget // MIB


def _device_memory(device: torch.device) -> tuple[int, int]:
    _, total = torch.cuda.mem_get_info(device)
    return total, torch.cuda.memory_reserved(device)
