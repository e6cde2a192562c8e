"""distserve.segmented_lru: one-off keys churn probation only; repeated keys survive a flood."""

import pytest

from distserve.segmented_lru import SegmentedLru


def test_a_key_seen_twice_survives_a_flood_of_one_off_keys():
    cache = SegmentedLru(4, probation_capacity=2)
    cache.put("hot", 1)
    assert cache.get("hot") == 1  # promoted
    for i in range(100):
        cache.put(f"cold{i}", i)
    assert cache.get("hot") == 1
    assert cache.keys() == ("cold98", "cold99", "hot")


def test_one_off_keys_are_evicted_least_recently_used_first():
    cache = SegmentedLru(3, probation_capacity=2)
    for key in "abc":
        cache.put(key, key)
    assert cache.get("a") is None
    assert cache.keys() == ("b", "c")
    assert len(cache) == 2


def test_protected_overflow_demotes_its_oldest_to_probation_where_a_hit_saves_it():
    cache = SegmentedLru(3, probation_capacity=1)  # 2 protected
    for key in "abc":
        cache.put(key, key)
        cache.get(key)  # a, b, c promoted in turn: a is demoted
    assert cache.protected_keys() == ("b", "c")
    assert cache.keys() == ("a", "b", "c")
    assert cache.get("a") == "a"  # promoted again, demoting b
    assert cache.protected_keys() == ("c", "a")


def test_put_of_a_known_key_replaces_its_value_in_place():
    cache = SegmentedLru(3, probation_capacity=1)
    cache.put("a", 1)
    cache.get("a")
    cache.put("a", 2)
    assert cache.protected_keys() == ("a",) and cache.get("a") == 2
    cache.put("b", 1)
    cache.put("b", 3)
    assert cache.get("b") == 3


@pytest.mark.parametrize("capacity, probation", [(4, 0), (4, 4), (1, 1)])
def test_sizes_are_checked(capacity, probation):
    with pytest.raises(ValueError, match="probation_capacity"):
        SegmentedLru(capacity, probation)
