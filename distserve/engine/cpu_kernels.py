"""Compiled CPU kernels (distserve/engine/csrc), built on first use with torch's C++ extension
loader and cached per machine (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR).

Built for this machine's CPU (-march=native), so a build is never shared between machines.
When it cannot be built (no compiler), or DISTSERVE_CPU_KERNELS=0, callers use the torch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("paged_attention.cpp", "skinny_matmul.cpp", "prefill_attention.cpp",
                                      "silu_and_mul.cpp", "norm_rope.cpp", "decode_attention_bf16.cpp",
                                      "decode_attention_f32.cpp", "decode_attention_avx2.cpp",
                                      "prefill_attention_avx2.cpp", "decode_layer.cpp", "sampling_weights.cpp",
                                      "small_ops_f32.cpp")]
# at::parallel_for is a header template: built without OpenMP it runs every loop on the calling thread,
# so a worker with several cores ran our kernels on one. With it, bf16 decode steps on 2 threads (ctx
# 256, medians of 5 interleaved runs): batch 8 / 32 / 64 11.9 / 24.0 / 33.0 -> 9.0 / 18.1 / 24.3 ms.
# The OpenMP runtime the kernels link (libgomp.so.1) is the one torch loaded before them, so they
# share torch's thread pool and its thread count.
OPENMP_FLAGS = ("-fopenmp",)
# Tuples: torch's loader appends its own flags to the lists it is given, in place.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", *OPENMP_FLAGS)
# Longest a worker waits for another process's build of the same kernels (a cold build takes 1-3 min
# on 2 cores) before it gives up and starts on the torch path.
BUILD_WAIT_S = 900.0
TORCH_BATON = "lock"  # the file torch's loader creates (O_EXCL) while it builds, and removes after
BUILD_FLOCK = "distserve-build.flock"
_lock = threading.Lock()
_module = None
_tried = False
_present: dict[str, bool] = {}  # has_op's answers, by op name


# The instruction sets each vector kernel is compiled for: csrc/ builds it where the CPU has one of them
# (-march=native picks the widest), else not at all. The float32 kernels have an AVX2 + FMA body too,
# for CPUs without AVX-512 (AMD Zen 2/3, older Xeons).
AVX512 = frozenset({"avx512f"})
AVX512_BF16 = frozenset({"avx512f", "avx512_bf16"})
AVX2_FMA = frozenset({"avx2", "fma"})  # also the AVX2 path of skinny_linear (float32)
ANY_CPU = frozenset()  # plain loops the compiler vectorises for whatever the CPU has
KERNEL_CPU_FLAGS = {
    "add_rms_norm_f32": (ANY_CPU,),
    "rope_f32_": (ANY_CPU,),
    "silu_and_mul_f32": (ANY_CPU,),
    "paged_decode_attention_f32": (AVX512, AVX2_FMA),
    "sampling_weights_f32": (AVX512, AVX2_FMA),
    "prefill_attention_f32": (AVX512, AVX2_FMA),
    "paged_decode_attention_bf16": (AVX512_BF16,),
    "prefill_attention_bf16": (AVX512_BF16,),
    "silu_and_mul_bf16": (AVX512_BF16,),
    "add_rms_norm_bf16": (AVX512_BF16,),
    "rope_bf16_": (AVX512_BF16,),
}


def cpu_can_run(op: str, flags) -> bool:
    """Whether a CPU with `flags` (its /proc/cpuinfo flags) has one of the instruction sets `op` is built for."""
    return any(needed <= flags for needed in KERNEL_CPU_FLAGS[op])


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether DISTSERVE_CPU_KERNELS in `environ` (default: this process's environment) allows the kernels."""
    return (os.environ if environ is None else environ).get("DISTSERVE_CPU_KERNELS", "1") not in ("0", "false", "off")


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


def _build_name(flags) -> str:
    """The extension's name, with a digest of every source, header and flag in it, of where the
    sources are and of the Python environment. torch's loader keeps one build per name and rebuilds
    when a source or flag changes, but not a header; and two checkouts or environments sharing the
    build cache would take turns rebuilding it, as build.ninja names the sources and torch's headers
    by absolute path (a restarted worker of one once waited a minute for that). With the digest in
    the name each build has its own folder."""
    digest = hashlib.sha1(" ".join(flags).encode())
    digest.update(f"{_CSRC.resolve()}\0{sys.prefix}".encode())
    for path in sorted([*_SOURCES, *_CSRC.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    return f"distserve_cpu_kernels_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    """Where the build named `name` lives: $TORCH_EXTENSIONS_DIR/name, else torch's default root,
    per Python version (the .so links one libpython ABI)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = os.path.join(get_default_build_root(), f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    return Path(root) / name


def kernels_build_directory() -> Path:
    """The folder of this checkout's kernel build (sources and flags as they are now)."""
    return build_directory(_build_name(COMPILE_FLAGS))


def is_built() -> bool:
    """Whether this machine has a build of the kernels as they are now (a load then only links it), without
    loading it: `distserve up` announces a build before it starts one."""
    directory = kernels_build_directory()
    return (directory / f"{directory.name}.so").is_file()


def ninja_directory() -> str:
    """The folder of the ninja this environment installed (the `ninja` package, a dependency).

    torch's loader runs whichever `ninja` is first on PATH. setup.sh builds without the virtual
    environment on PATH, the tests and workers run with it, and a system ninja 1.11 and the
    package's 1.13 each discard the other's build log ("build log version is too old"), so every
    switch rebuilt all kernels: 2-4 min on 2 cores, and CI's first worker was not healthy in time."""
    try:
        import ninja

        return ninja.BIN_DIR
    except (ImportError, AttributeError):
        return os.path.dirname(sys.executable)


@contextlib.contextmanager
def ninja_first_on_path():
    """Puts ninja_directory() first on PATH while torch's loader builds, then restores PATH."""
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([ninja_directory(), *([before] if before else [])])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


@contextlib.contextmanager
def build_guard(directory: Path, wait_s: float = BUILD_WAIT_S):
    """Hold the build of `directory` for this process: one builder at a time, and no stale lock.

    torch's loader serialises builders with a file it creates with O_EXCL and removes when done; a
    builder killed mid-build leaves it, and every later load waits on it forever (a worker killed while
    it started once left every later start hanging). Here each builder first takes an flock, which dies
    with its process; whoever holds it is the only builder of this name, so a torch lock file found
    then is a dead builder's and is removed. Raises TimeoutError after `wait_s` of another live build."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / BUILD_FLOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"another process has been building {directory} for {wait_s:.0f} s")
                time.sleep(0.2)
        stale = directory / TORCH_BATON
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock


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

                directory = kernels_build_directory()
                with build_guard(directory), ninja_first_on_path():
                    load(name=directory.name, sources=[str(p) for p in _SOURCES], is_python_module=False,
                         extra_cflags=list(COMPILE_FLAGS), extra_ldflags=list(OPENMP_FLAGS),
                         build_directory=str(directory), verbose=False)
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
