"""WorkerPicker: least-loaded choice from registry records plus the router's own in-flight counts."""

from __future__ import annotations

from distserve.registry import WorkerRecord
from services.router.picker import WorkerPicker


def picker_with(prefill: list[WorkerRecord], decode: list[WorkerRecord]) -> WorkerPicker:
    picker = WorkerPicker(registry=None, suspect_s=5.0)
    picker._workers = {"prefill": prefill, "decode": decode}
    return picker


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
