"""The prefix-cache key chain: full blocks only, position-dependent, namespaced by model, dtype,
block size, deployment seed and cache_salt."""

from __future__ import annotations

import pytest

from distserve.prefix_hash import PrefixNamespace, block_keys, reusable_keys

NAMESPACE = PrefixNamespace("default:tiny", "float32", 4)
SEED = NAMESPACE.seed()


def test_only_full_blocks_are_keyed():
    assert len(block_keys(list(range(11)), 4, SEED)) == 2
    assert len(block_keys(list(range(12)), 4, SEED)) == 3
    assert block_keys(list(range(3)), 4, SEED) == []
    assert len(block_keys(list(range(100)), 4, SEED, max_blocks=5)) == 5


def test_equal_prefixes_give_equal_keys_and_a_change_changes_every_later_key():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, SEED)
    b = block_keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], 4, SEED)
    c = block_keys([1, 2, 3, 9, 5, 6, 7, 8, 9, 10, 11, 12], 4, SEED)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert all(x != y for x, y in zip(a, c))  # the chain: a change in block 0 changes every key after it


def test_a_block_keyed_at_another_position_differs():
    block = [5, 6, 7, 8]
    assert block_keys(block + block, 4, SEED)[1] != block_keys(block, 4, SEED)[0]


@pytest.mark.parametrize("other", [
    PrefixNamespace("default:small", "float32", 4),
    PrefixNamespace("default:tiny", "bfloat16", 4),
    PrefixNamespace("default:tiny", "float32", 4, deployment_seed="prod"),
])
def test_the_namespace_seeds_the_chain(other):
    tokens = list(range(8))
    assert block_keys(tokens, 4, other.seed()) != block_keys(tokens, 4, SEED)


def test_salts_separate_and_equal_salts_share():
    tokens = list(range(8))
    assert block_keys(tokens, 4, NAMESPACE.seed("tenant-a")) != block_keys(tokens, 4, NAMESPACE.seed("tenant-b"))
    assert block_keys(tokens, 4, NAMESPACE.seed("tenant-a")) == block_keys(tokens, 4, NAMESPACE.seed("tenant-a"))
    assert block_keys(tokens, 4, NAMESPACE.seed("tenant-a")) != block_keys(tokens, 4, SEED)


def test_keys_are_stable_across_processes():
    """Per deployment, not per process: a fixed value pins the spec (a change needs a new HASH_VERSION)."""
    key = block_keys([1, 2, 3, 4], 4, NAMESPACE.seed())[0]
    assert key.hex()[:16] == PINNED_KEY_PREFIX


PINNED_KEY_PREFIX = __import__("hashlib").sha256(
    __import__("hashlib").sha256("\x00".join(["distserve-prefix-v1", "default:tiny", "float32", "4", "", ""]).encode())
    .digest() + bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0])).hexdigest()[:16]


def test_a_prompt_may_reuse_its_full_blocks_short_of_its_last_token():
    keys = [b"a", b"b", b"c"]
    assert reusable_keys(keys, num_prompt_tokens=12, block_size=4) == [b"a", b"b"]  # 12 is full: last computed
    assert reusable_keys(keys, num_prompt_tokens=13, block_size=4) == keys
    assert reusable_keys(keys, num_prompt_tokens=1, block_size=4) == []
