"""CPU memory on 2 MiB pages for the tensors a decode step streams end to end: the weights, and the
paged KV cache (`zeros`), whose blocks attention reads scattered, 8 KiB at a time.

A small-batch decode step reads every weight matrix once, so it runs at the speed one core streams
memory. On 4 KiB pages that stream takes a TLB miss every 4 KiB; on transparent huge pages one every
2 MiB. Measured on one core of the 2-core box, streaming a default:small model's linears at batch 1
(csrc/skinny_matmul.cpp): 17-20 GB/s from ordinary pages, 24-25 GB/s from huge pages, which is what
torch's own single-stream sum reads.

torch's CPU allocator takes large blocks from malloc, which the kernel backs with 4 KiB pages unless
THP is set to "always" (the common default is "madvise"). So the arena maps anonymous memory itself,
advises MADV_HUGEPAGE, and hands out tensors carved from it. Where the advice is not available (not
Linux, THP "never") the memory is ordinary pages and nothing else changes.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20  # mapped at a time; pages are only committed where tensors are written
ALIGNMENT = 64  # a cache line: every tensor starts on one, as the kernels' vector loads prefer


def huge_pages_advisable() -> bool:
    """True where anonymous memory can be advised onto transparent huge pages."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE")


class HugePageArena:
    """Hands out contiguous CPU tensors from huge-page-advised mappings. A tensor keeps its mapping
    alive; a mapping is unmapped once none of its tensors is left. Not thread-safe: fill it while
    loading a model."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self._chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 view of the current mapping, from a 2 MiB boundary
        self._used = 0

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype`."""
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        if self._chunk is None or self._used + num_bytes > self._chunk.numel():
            self._chunk, self._used = _map(max(self._chunk_bytes, num_bytes)), 0
        start = self._used
        self._used = -(-(start + num_bytes) // ALIGNMENT) * ALIGNMENT
        return self._chunk[start:start + num_bytes].view(dtype).view(shape)

    def copy_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of a CPU `tensor` in the arena (contiguous, same dtype and shape)."""
        out = self.empty(tensor.shape, tensor.dtype)
        out.copy_(tensor)
        return out


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled contiguous CPU tensor on memory of its own, advised onto huge pages: fresh
    anonymous memory reads as zeros, and a page is only committed where it is written.

    For the paged KV cache: decode attention reads each sequence's blocks scattered over the cache,
    on 4 KiB pages a TLB miss per block or two. One decode step's attention (default:small bf16, batch
    25 x 290 tokens, blocks scattered over a 1 GiB cache, one core; /tmp harness kvhp.py, three runs):
    11.3 / 10.8 / 8.5 ms on 4 KiB pages, 8.4 / 7.4 / 6.0 ms on huge pages."""
    if not huge_pages_advisable():  # _map would hand out torch.empty's memory, which is not zeroed
        return torch.zeros(shape, dtype=dtype)
    return _map(torch.Size(shape).numel() * dtype.itemsize).view(dtype).view(shape)


def _map(num_bytes: int) -> torch.Tensor:
    """A uint8 tensor over fresh anonymous memory of at least `num_bytes`, starting on a 2 MiB boundary
    (a huge page can only back an aligned 2 MiB range)."""
    if not huge_pages_advisable():
        return torch.empty(num_bytes, dtype=torch.uint8)
    size = -(-num_bytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out: ordinary pages
        pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` open while any view lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + num_bytes]
