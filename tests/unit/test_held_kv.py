"""HeldKv: prompt KV buffers kept for decode workers until freed or expired, under a byte cap,
each with its puller's secret and its checksum."""

from __future__ import annotations

import time

import google_crc32c
import pytest

from services.prefill.held_kv import HeldKv
from tests.builders import model_spec, random_kv

SPEC = model_spec()
CAP = 1 << 30


def nbytes(kv) -> int:
    return kv.numel() * kv.element_size()


def test_add_then_lookup_returns_the_same_tensor():
    held = HeldKv(CAP)
    kv = random_kv(5, SPEC)
    held.add("h1", kv, lease_s=30)
    assert held.lookup("h1") is kv
    assert held.lookup("other") is None
    assert held.num_held == 1 and held.num_bytes == nbytes(kv)


def test_add_returns_the_crc32c_of_the_bytes_held():
    kv = random_kv(5, SPEC)
    assert HeldKv(CAP).add("h1", kv, lease_s=30) == google_crc32c.value(kv.numpy().tobytes())
    other = random_kv(5, SPEC, seed=1)
    assert HeldKv(CAP).add("h1", other, lease_s=30) != google_crc32c.value(kv.numpy().tobytes())


def test_free_is_idempotent():
    held = HeldKv(CAP)
    held.add("h1", random_kv(3, SPEC), lease_s=30)
    held.add("h2", random_kv(4, SPEC), lease_s=30)
    assert held.free("h1") is True
    assert held.free("h1") is False
    assert held.free("never-added") is False
    assert held.lookup("h1") is None and held.lookup("h2") is not None
    assert held.num_held == 1 and held.num_bytes == nbytes(random_kv(4, SPEC))


def test_expire_frees_only_passed_leases():
    held = HeldKv(CAP)
    now = time.monotonic()
    held.add("short", random_kv(2, SPEC), lease_s=1)
    held.add("long", random_kv(2, SPEC), lease_s=100)
    assert held.expire(now) == []
    assert held.expire(now + 2) == ["short"]
    assert held.lookup("short") is None and held.lookup("long") is not None
    assert held.expire(now + 2) == []
    assert held.expire(now + 101) == ["long"]
    assert held.num_held == 0 and held.num_bytes == 0


def test_an_id_already_held_is_refused_and_keeps_its_buffer():
    held = HeldKv(CAP)
    first = random_kv(2, SPEC)
    held.add("h", first, lease_s=30)
    assert held.is_holding("h") and not held.is_holding("other")
    with pytest.raises(ValueError, match="already held"):
        held.add("h", random_kv(6, SPEC, seed=1), lease_s=100)
    assert held.lookup("h") is first and held.num_held == 1 and held.num_bytes == nbytes(first)


def test_the_cap_bounds_the_bytes_held_and_freeing_makes_room():
    kv = random_kv(4, SPEC)
    held = HeldKv(max_bytes=2 * nbytes(kv))
    held.add("a", kv, lease_s=30)
    assert held.can_hold(nbytes(kv)) and not held.can_hold(nbytes(kv) + 1)
    held.add("b", random_kv(4, SPEC, seed=1), lease_s=30)
    assert not held.can_hold(1)
    with pytest.raises(ValueError, match="over the cap"):
        held.add("c", random_kv(4, SPEC, seed=2), lease_s=30)
    assert held.lookup("c") is None and held.num_bytes == 2 * nbytes(kv)
    held.free("a")
    assert held.can_hold(nbytes(kv)) and held.num_bytes == nbytes(kv)


def test_only_the_secret_held_with_the_kv_admits_a_puller():
    held = HeldKv(CAP)
    held.add("s", random_kv(2, SPEC), lease_s=30, secret="tok-123")
    assert held.admits("s", "tok-123")
    assert not held.admits("s", "") and not held.admits("s", "tok-12") and not held.admits("s", "tok-1234")
    assert not held.admits("missing", "tok-123")


def test_a_handle_held_without_a_secret_admits_no_puller():
    held = HeldKv(CAP)
    held.add("open", random_kv(2, SPEC), lease_s=30)
    assert not held.admits("open", "") and not held.admits("open", "something")
