"""Which compiled CPU kernels this machine has.

csrc/ builds each vector kernel only where the CPU has its instructions (AVX-512, or AVX2 + FMA for the
float32 ones) (-march=native), and the
engine then takes the torch or portable path. Tests of a kernel use `compiled_op`: it checks that the
build holds the op exactly where the CPU can run it, and gives the op or None; on a CPU without it,
the test checks the path the engine takes instead against the same reference.
"""

from __future__ import annotations

from distserve.engine.cpu_kernels import cpu_can_run, cpu_kernels, has_op
from distserve.engine.dtype import cpu_flags


def cpu_runs(op: str) -> bool:
    """Whether this CPU has the instructions `op` needs."""
    return cpu_can_run(op, cpu_flags())


def compiled_op(op: str):
    """torch.ops.distserve.<op> where this CPU can run it, else None; asserts the build agrees."""
    kernels = cpu_kernels()
    assert kernels is not None, "the CPU kernels must build here (compiler and ninja are installed)"
    assert has_op(kernels, op) == cpu_runs(op), f"{op} built: {has_op(kernels, op)}, CPU runs it: {cpu_runs(op)}"
    return getattr(kernels, op) if cpu_runs(op) else None
