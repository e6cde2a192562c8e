"""Choosing the model dtype: `auto` picks bfloat16 where the hardware computes it natively."""

from __future__ import annotations

import functools
import logging


log = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # torch's names; this module imports no torch (the CLI uses it)
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)


def torch_dtype(name: str):
    """The torch.dtype named `name`, one of DTYPE_NAMES."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype: {name!r} is not one of {DTYPE_NAMES}")
    return getattr(torch, name)
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags() -> set[str]:
    """The feature flags of the first CPU in /proc/cpuinfo; empty where there is none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


@functools.cache
def cpu_has_amx() -> bool:
    """Whether the CPU multiplies bf16 matrices on AMX tiles: oneDNN uses them, and with it torch's bf16
    matmuls and SDPA's CPU flash kernel (its GEMMs). Read once: callers ask on the hot path."""
    return "amx_bf16" in cpu_flags()


def resolve_dtype(name: str, device: str) -> str:
    """Returns one of DTYPE_NAMES. Explicit names pass through; `auto` is bfloat16 on CUDA, and on CPU
    when it has bf16 instructions (AMX or AVX512-BF16), else float32 (bf16 emulated on CPU is slower
    than fp32)."""
    if name != "auto":
        return name
    if device.startswith("cuda"):
        resolved = "bfloat16"
    elif device == "cpu" and cpu_flags() & set(BF16_CPU_FLAGS):
        resolved = "bfloat16"
    else:
        resolved = "float32"
    log.info("dtype auto -> %s on %s", resolved, device)
    return resolved
