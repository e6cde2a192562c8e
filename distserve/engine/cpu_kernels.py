"""Compiled CPU kernels (distserve/engine/csrc), built on first use with torch's C++ extension
loader and cached per machine (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR).

Built for this machine's CPU (-march=native), so a build is never shared between machines.
When it cannot be built (no compiler), or DISTSERVE_CPU_KERNELS=0, callers use the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_attention.cpp", "skinny_matmul.cpp", "prefill_attention.cpp",
                                      "silu_and_mul.cpp", "norm_rope.cpp", "decode_attention_bf16.cpp",
                                      "decode_attention_f32.cpp", "decode_layer.cpp")]
# at::parallel_for is a header template: built without OpenMP it runs every loop on the calling thread,
# so a worker with several cores ran our kernels on one. With it, bf16 decode steps on 2 threads (ctx
# 256, medians of 5 interleaved runs): batch 8 / 32 / 64 11.9 / 24.0 / 33.0 -> 9.0 / 18.1 / 24.3 ms.
# The OpenMP runtime the kernels link (libgomp.so.1) is the one torch loaded before them, so they
# share torch's thread pool and its thread count.
OPENMP_FLAGS = ["-fopenmp"]
_lock = threading.Lock()
_module = None
_tried = False
_present: dict[str, bool] = {}  # has_op's answers, by op name


def enabled() -> bool:
    return os.environ.get("DISTSERVE_CPU_KERNELS", "1") not in ("0", "false", "off")


def has_op(kernels, name: str) -> bool:
    """Whether the built kernels include `name` (some are compiled only for CPUs with the instructions
    they need, e.g. prefill_attention_bf16 needs AVX512-BF16). Looked up once per name: callers ask
    on the hot path (every layer of a prefill)."""
    if name not in _present:
        try:
            getattr(kernels, name)
            _present[name] = True
        except (AttributeError, RuntimeError):
            _present[name] = False
    return _present[name]


def cpu_kernels_with(like, name: str):
    """torch.ops.distserve when `like` is a CPU tensor and the build has op `name` (some are compiled
    only where the CPU has the instructions they need), else None: the caller keeps torch's ops."""
    if like.device.type != "cpu":
        return None
    kernels = cpu_kernels()
    return kernels if kernels is not None and has_op(kernels, name) else None


def bf16_cpu_kernels(like, name: str):
    """cpu_kernels_with for a bfloat16 `like` (the bf16-only ops), else None."""
    import torch

    return cpu_kernels_with(like, name) if like.dtype == torch.bfloat16 else None


def _build_name(flags: list[str]) -> str:
    """The extension's name, with a digest of every source, header and flag in it. torch's loader
    keeps one build per name and rebuilds when a source or flag changes, but not a header; and two
    checkouts sharing the build cache would take turns rebuilding it (a restarted worker of one once
    waited a minute for that). With the digest in the name each build has its own folder."""
    digest = hashlib.sha1(" ".join(flags).encode())
    for path in sorted([*_SOURCES, *_CSRC.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    return f"distserve_cpu_kernels_{digest.hexdigest()[:12]}"


def cpu_kernels():
    """torch.ops.distserve (paged_decode_attention, skinny_linear, prefill_attention_bf16 where the CPU
    has AVX512-BF16) once built and loaded, or None. Idempotent."""
    global _module, _tried
    if not enabled():
        return None
    if _tried:  # the hot path (once per decode step): no lock once the build was attempted
        return _module
    with _lock:
        if not _tried:
            _tried = True
            try:
                import torch
                from torch.utils.cpp_extension import load

                flags = ["-O3", "-march=native", "-ffast-math", *OPENMP_FLAGS]
                load(name=_build_name(flags), sources=[str(p) for p in _SOURCES], is_python_module=False,
                     extra_cflags=flags, extra_ldflags=OPENMP_FLAGS, verbose=False)
                _module = torch.ops.distserve
            except Exception as exc:  # no compiler or ninja: the torch path still works, only slower
                log.warning("CPU kernels unavailable, using torch attention: %s", exc)
        return _module


if __name__ == "__main__":  # python -m distserve.engine.cpu_kernels: build now (setup does), report
    import sys

    logging.basicConfig(level=logging.INFO)
    built = cpu_kernels() is not None
    print("CPU kernels:", "built" if built else "unavailable (workers use the torch path)")
    sys.exit(0 if built else 1)
