"""PrefixIndex / PromptBlocks: a router's estimate of what each worker's prefix cache holds."""

from __future__ import annotations

from distserve.prefix_index import PrefixIndex, PromptBlocks


def blocks(tokens: list[int], salt: str = "") -> list[bytes]:
    return PromptBlocks("m", tokens, salt).keys(4)


def test_the_expected_hit_is_the_longest_recorded_run_from_the_first_block():
    index = PrefixIndex()
    index.record("w", blocks(list(range(12))))  # 3 full blocks
    assert index.cached_blocks("w", blocks(list(range(12)) + [99] * 5)) == 3
    assert index.cached_blocks("w", blocks(list(range(8)) + [7, 7, 7, 7])) == 2  # differs in block 3
    assert index.cached_blocks("w", blocks([5] + list(range(1, 12)))) == 0  # differs in block 1: no run
    assert index.cached_blocks("other", blocks(list(range(12)))) == 0


def test_keys_are_chained_and_namespaced_by_the_salt_and_block_size():
    prompt = list(range(16))
    assert blocks(prompt)[1] != PromptBlocks("m", [9, 9, 9, 9] + prompt[4:], "").keys(4)[1]  # a block's key covers its prefix
    assert blocks(prompt, "a") != blocks(prompt, "b")
    index = PrefixIndex()
    index.record("w", blocks(prompt, "a"))
    assert index.cached_blocks("w", blocks(prompt, "b")) == 0
    assert index.cached_blocks("w", blocks(prompt, "a")) == 4
    assert len(PromptBlocks("m", prompt).keys(16)) == 1 and len(PromptBlocks("m", prompt[:15]).keys(16)) == 0


def test_a_worker_record_keeps_its_capacity_dropping_least_recently_used_chains_tail_first():
    index = PrefixIndex()
    old, new = blocks(list(range(8))), blocks(list(range(100, 108)))
    index.record("w", old, capacity=3)
    index.record("w", new, capacity=3)  # 4 keys > 3: old's tail goes first, its head stays
    assert index.num_blocks("w") == 3
    assert index.cached_blocks("w", new) == 2
    assert index.cached_blocks("w", old) == 1
    index.record("w", old, capacity=3)  # routed again: old is the newest now
    assert index.cached_blocks("w", old) == 2 and index.cached_blocks("w", new) == 1


def test_workers_gone_from_the_registry_are_forgotten():
    index = PrefixIndex()
    index.record("a", blocks(list(range(8))))
    index.record("b", blocks(list(range(8))))
    index.retain({"b"})
    assert index.num_blocks("a") == 0 and index.cached_blocks("b", blocks(list(range(8)))) == 2
