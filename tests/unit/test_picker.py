"""WorkerPicker: least-loaded choice from registry records plus the router's own in-flight counts."""

from __future__ import annotations

from distserve.registry import WorkerRecord
from services.router.picker import WorkerPicker


def picker_with(prefill: list[WorkerRecord], decode: list[WorkerRecord],
                colocated: list[WorkerRecord] = ()) -> WorkerPicker:
    picker = WorkerPicker(registry=None, suspect_s=5.0)
    picker._workers = {"prefill": prefill, "decode": decode, "colocated": list(colocated)}
    return picker


def colocated(worker_id: str, outstanding: int = 0, running: int = 0, total: int = 100):
    load = {"outstanding_tokens": outstanding, "num_running": running, "total_blocks": total, "block_size": 16}
    return WorkerRecord(worker_id, "colocated", f"{worker_id}:1", load=load)


def decode(worker_id: str, running: int = 0, free: int = 100, total: int = 100, fmt: str = "2x2x16:float32"):
    load = {"num_running": running, "free_blocks": free, "total_blocks": total, "block_size": 16}
    return WorkerRecord(worker_id, "decode", f"{worker_id}:1", load=load, kv_format=fmt)


def test_prefill_with_fewest_outstanding_tokens_counting_in_flight():
    a = WorkerRecord("a", "prefill", "a:1", load={"outstanding_tokens": 100})
    b = WorkerRecord("b", "prefill", "b:1", load={"outstanding_tokens": 50})
    picker = picker_with([a, b], [])
    assert picker.pick_prefill() is b
    with picker.track(b, 80):
        assert picker.pick_prefill() is a


def test_decode_prefers_free_blocks_then_fewest_running():
    busy, idle_small, idle_big = decode("busy", running=3), decode("small", free=10), decode("big", free=50)
    picker = picker_with([], [busy, idle_small, idle_big])
    assert picker.pick_decode(num_tokens=100) is idle_big
    assert picker.pick_decode(num_tokens=1000) is busy  # 63 blocks: only busy has them free now
    assert picker.pick_decode(num_tokens=5000) is None  # no worker can ever hold 313 blocks


def test_decode_must_take_the_prefill_workers_kv_format():
    fp32, bf16 = decode("fp32"), decode("bf16", fmt="2x2x16:bfloat16")
    picker = picker_with([], [fp32, bf16])
    assert picker.pick_decode(10, "2x2x16:bfloat16") is bf16
    assert picker.pick_decode(10, "8x4x64:float32") is None


def test_suspect_worker_is_skipped():
    a, b = decode("a"), decode("b", running=5)
    picker = picker_with([], [a, b])
    picker.mark_suspect(a)
    assert picker.pick_decode(10) is b


def test_when_every_worker_is_suspect_they_are_all_tried_rather_than_none():
    a, b = decode("a"), decode("b", running=5)
    picker = picker_with([], [a, b])
    picker.mark_suspect(a)
    picker.mark_suspect(b)
    assert picker.pick_decode(10) is a  # back to plain least-loaded: a restarted worker may be fine
    assert picker_with([], []).pick_decode(10) is None


def test_colocated_with_fewest_outstanding_tokens_that_can_hold_the_request():
    busy, idle, tiny = colocated("busy", outstanding=500), colocated("idle", running=9), colocated("tiny", total=1)
    picker = picker_with([], [], [busy, idle, tiny])
    assert picker.pick_colocated(num_tokens=10) is tiny  # fewest outstanding, then fewest running
    assert picker.pick_colocated(num_tokens=100) is idle  # tiny holds only 16 tokens
    with picker.track(idle, 600):
        assert picker.pick_colocated(num_tokens=100) is busy
    assert picker.pick_colocated(num_tokens=5000) is None


def test_mixed_fleet_prefers_the_less_loaded_kind_and_ties_go_to_the_pair():
    pair = WorkerRecord("p", "prefill", "p:1", load={"outstanding_tokens": 100})
    picker = picker_with([pair], [decode("d")], [colocated("c", outstanding=100)])
    both = picker.workers("colocated")[0], pair
    assert not picker.prefers_colocated(*both)
    with picker.track(pair, 1):
        assert picker.prefers_colocated(*both)
    assert picker.prefers_colocated(both[0], None) and not picker.prefers_colocated(None, pair)
