"""Which GPU each worker of `distserve up --gpus` runs on, and what share of its memory it may take
(torch-free: the launcher plans this before any worker imports torch).

Workers are dealt round the listed GPUs in start order (prefill-0, prefill-1, ..., decode-0, ...,
colocated-0, ...), so with as many GPUs as workers each has its own. GPUs are numbered as nvidia-smi
does (PCI bus order), or, where the launcher runs inside an allocation (its own CUDA_VISIBLE_DEVICES), as
positions in that. A worker sees only its GPU (CUDA_VISIBLE_DEVICES), as `cuda`, and sizes its KV cache from that GPU's memory: the GPU's memory
fraction (--gpu-memory-fraction) split evenly among the workers dealt to it. With one GPU, prefill and
decode workers share it half and half (the stated split); a colocated worker alone takes it whole.
"""

from __future__ import annotations

import dataclasses

from distserve.config import ConfigError


@dataclasses.dataclass(frozen=True)
class GpuShare:
    gpu: str  # the GPU as CUDA_VISIBLE_DEVICES names it to the worker (an index in PCI bus order, or a UUID)
    memory_fraction: float  # of the GPU's total memory this worker's weights, activations and KV may use

    def env(self) -> dict[str, str]:
        """What the worker is started with: only its GPU visible, numbered as nvidia-smi does."""
        return {"CUDA_VISIBLE_DEVICES": self.gpu, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "DISTSERVE_DEVICE": "cuda",
                "DISTSERVE_GPU_MEMORY_FRACTION": f"{self.memory_fraction:.6g}"}


def parse_gpu_list(text: str) -> list[int]:
    """"0,1,3" -> [0, 1, 3]; ConfigError naming `gpus` for anything else (or a repeated GPU)."""
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"gpus: expected GPU indices separated by commas, e.g. 0,1, got {text!r}") from None
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ConfigError(f"gpus: expected distinct GPU indices >= 0, e.g. 0,1, got {text!r}")
    return gpus


def plan_gpus(worker_names: list[str], gpus: list[int], memory_fraction: float,
              visible: str | None = None) -> dict[str, GpuShare]:
    """Each worker's GPU and memory share: round-robin in the given order, `memory_fraction` of each GPU
    split evenly among its workers. `visible`: the launcher's own CUDA_VISIBLE_DEVICES (a scheduler's or
    container's allocation), if set: `gpus` then index into it, so no worker leaves the allocation."""
    if not 0 < memory_fraction <= 1:
        raise ConfigError(f"gpu_memory_fraction: must be in (0, 1], got {memory_fraction}")
    if not gpus:
        return {}
    allocated = [part.strip() for part in visible.split(",") if part.strip()] if visible is not None else None
    if allocated is not None and max(gpus) >= len(allocated):
        raise ConfigError(f"gpus: {max(gpus)} is beyond the {len(allocated)} GPU(s) this process may use "
                          f"(CUDA_VISIBLE_DEVICES={visible!r}); --gpus counts those from 0")
    dealt = {name: gpus[i % len(gpus)] for i, name in enumerate(worker_names)}
    sharing = {gpu: sum(1 for g in dealt.values() if g == gpu) for gpu in gpus}
    named = (lambda gpu: allocated[gpu]) if allocated is not None else str  # noqa: E731
    return {name: GpuShare(named(gpu), memory_fraction / sharing[gpu]) for name, gpu in dealt.items()}
