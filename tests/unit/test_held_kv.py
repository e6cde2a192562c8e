"""HeldKv: prompt KV buffers kept for decode workers until freed or expired."""

from __future__ import annotations

import time

from services.prefill.held_kv import HeldKv
from tests.builders import model_spec, random_kv

SPEC = model_spec()


def test_add_then_lookup_returns_the_same_tensor():
    held = HeldKv()
    kv = random_kv(5, SPEC)
    held.add("h1", kv, lease_s=30)
    assert held.lookup("h1") is kv
    assert held.lookup("other") is None
    assert held.num_held == 1 and held.num_bytes == kv.numel() * kv.element_size()


def test_free_is_idempotent():
    held = HeldKv()
    held.add("h1", random_kv(3, SPEC), lease_s=30)
    held.add("h2", random_kv(4, SPEC), lease_s=30)
    assert held.free("h1") is True
    assert held.free("h1") is False
    assert held.free("never-added") is False
    assert held.lookup("h1") is None and held.lookup("h2") is not None
    assert held.num_held == 1 and held.num_bytes == random_kv(4, SPEC).numel() * 4


def test_expire_frees_only_passed_leases():
    held = HeldKv()
    now = time.monotonic()
    held.add("short", random_kv(2, SPEC), lease_s=1)
    held.add("long", random_kv(2, SPEC), lease_s=100)
    assert held.expire(now) == []
    assert held.expire(now + 2) == ["short"]
    assert held.lookup("short") is None and held.lookup("long") is not None
    assert held.expire(now + 2) == []
    assert held.expire(now + 101) == ["long"]
    assert held.num_held == 0 and held.num_bytes == 0


def test_adding_again_replaces_buffer_and_lease():
    held = HeldKv()
    now = time.monotonic()
    held.add("h", random_kv(2, SPEC), lease_s=1)
    replacement = random_kv(6, SPEC, seed=1)
    held.add("h", replacement, lease_s=100)
    assert held.expire(now + 2) == []
    assert held.lookup("h") is replacement and held.num_held == 1
