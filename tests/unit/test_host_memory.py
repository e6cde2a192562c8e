"""The huge-page arena that CPU weights live in, and the zeroed huge-page memory of the paged KV cache."""

import gc
from pathlib import Path

import pytest
import torch

from distserve.engine import host_memory
from distserve.engine.host_memory import HUGE_PAGE, HugePageArena, huge_pages_advisable
from distserve.engine.kv_cache import PagedKvCache
from distserve.engine.model_loader import load_engine_model


def test_tensors_are_cache_line_aligned_disjoint_and_outlive_the_arena():
    arena = HugePageArena(chunk_bytes=1 << 20)
    shapes = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((300, 1024), torch.float32), ((2, 2), torch.int64)]
    tensors = [arena.empty(shape, dtype) for shape, dtype in shapes]  # the third needs a chunk of its own
    for tensor, (shape, dtype) in zip(tensors, shapes):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.is_contiguous()
        assert tensor.data_ptr() % 64 == 0
    for i, tensor in enumerate(tensors):
        tensor.fill_(i + 1)
    del arena
    gc.collect()
    assert [int(t.flatten()[0]) for t in tensors] == [1, 2, 3, 4]  # no tensor overwrote another


def test_copy_of_is_an_equal_contiguous_copy():
    source = torch.randn(64, 48).t()  # not contiguous
    copy = HugePageArena().copy_of(source)
    assert copy.is_contiguous() and torch.equal(copy, source)
    source.zero_()
    assert copy.abs().sum() > 0


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _kernel_offers_huge_pages() -> bool:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return huge_pages_advisable() and thp.exists() and "[never]" not in thp.read_text()


def test_arena_memory_is_on_huge_pages_where_the_kernel_offers_them():
    if not _kernel_offers_huge_pages():
        assert HugePageArena().empty((4,), torch.float32).numel() == 4  # ordinary pages, same contract
        return
    weight = HugePageArena().empty((2 * HUGE_PAGE // 4,), torch.float32)
    assert weight.data_ptr() % HUGE_PAGE == 0
    weight.fill_(1.0)  # touching the range faults it in
    assert _anon_huge_kib(weight.data_ptr()) >= 2048


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_models_matrices_live_in_the_arena(tiny_model_path, dtype):
    weights = load_engine_model(tiny_model_path, dtype, "cpu").weights
    matrices = [weights.embed, weights.lm_head.weight] + [lin.weight for layer in weights.layers for lin in layer.linears]
    for matrix in matrices:
        assert matrix.data_ptr() % 64 == 0 and matrix.dtype == getattr(torch, dtype)
        if _kernel_offers_huge_pages():
            assert _anon_huge_kib(matrix.data_ptr()) >= 2048


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_is_zero_filled_writable_and_on_huge_pages_where_offered(dtype):
    tensor = host_memory.zeros((3, HUGE_PAGE // 4), dtype)
    assert tensor.shape == (3, HUGE_PAGE // 4) and tensor.dtype == dtype and tensor.is_contiguous()
    assert not tensor.any()
    tensor[1].fill_(2.0)
    assert tensor[1].eq(2).all() and not tensor[0].any() and not tensor[2].any()
    if _kernel_offers_huge_pages():
        assert tensor.data_ptr() % HUGE_PAGE == 0 and _anon_huge_kib(tensor.data_ptr()) >= 2048


def test_zeros_on_ordinary_pages_is_zeroed_too(monkeypatch):
    monkeypatch.setattr(host_memory, "huge_pages_advisable", lambda: False)
    dirty = torch.full((1 << 12,), 7.0)  # freed heap memory, which torch.empty hands out again
    del dirty
    assert not host_memory.zeros((1 << 12,), torch.float32).any()


def test_the_paged_kv_cache_lives_on_huge_pages_with_a_zero_pad_block():
    cache = PagedKvCache(2, 2, 64, 600, 16, torch.bfloat16, "cpu")
    assert not cache.storage[:, :, cache.pad_block].any()
    cache.write_slots(0, torch.tensor([0, 1]), torch.ones(2, 2, 64, dtype=torch.bfloat16),
                      torch.ones(2, 2, 64, dtype=torch.bfloat16))
    if _kernel_offers_huge_pages():
        assert _anon_huge_kib(cache.storage.data_ptr()) >= 2048
