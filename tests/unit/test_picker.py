"""WorkerPicker: least-loaded choice from registry records plus the router's own in-flight counts."""

from __future__ import annotations

import contextlib

import pytest

from distserve.prefix_index import PromptBlocks
from distserve.registry import RegistrySnapshot, WorkerRecord
from distserve.spill_policy import SpillPolicy
from services.router.picker import WorkerPicker


def picker_with(prefill: list[WorkerRecord], decode: list[WorkerRecord],
                colocated: list[WorkerRecord] = ()) -> WorkerPicker:
    picker = WorkerPicker(registry=None, suspect_s=5.0)
    picker._workers = {"prefill": prefill, "decode": decode, "colocated": list(colocated)}
    return picker


def colocated(worker_id: str, outstanding: int = 0, running: int = 0, total: int = 100):
    load = {"outstanding_tokens": outstanding, "num_running": running, "total_blocks": total, "block_size": 16}
    return WorkerRecord(worker_id, "colocated", f"{worker_id}:1", load=load)


def decode(worker_id: str, running: int = 0, free: int = 100, total: int = 100, fmt: str = "2x2x16:float32",
           caching: bool = True):
    load = {"num_running": running, "free_blocks": free, "total_blocks": total, "block_size": 16,
            "prefix_caching": int(caching)}
    return WorkerRecord(worker_id, "decode", f"{worker_id}:1", load=load, kv_format=fmt)


def test_prefill_with_fewest_outstanding_tokens_counting_in_flight():
    a = WorkerRecord("a", "prefill", "a:1", load={"outstanding_tokens": 100})
    b = WorkerRecord("b", "prefill", "b:1", load={"outstanding_tokens": 50})
    picker = picker_with([a, b], [])
    assert picker.pick_prefill() is b
    with picker.track_prompt(b, 80):
        assert picker.pick_prefill() is a


def test_decode_prefers_free_blocks_then_fewest_running():
    busy, idle_small, idle_big = decode("busy", running=3), decode("small", free=10), decode("big", free=50)
    picker = picker_with([], [busy, idle_small, idle_big])
    assert picker.pick_decode(num_tokens=100) is idle_big
    assert picker.pick_decode(num_tokens=1000) is busy  # 63 blocks: only busy has them free now
    assert picker.pick_decode(num_tokens=5000) is None  # no worker can ever hold 313 blocks


def test_a_retry_avoids_the_decode_workers_that_failed_it_while_another_fits():
    best, other = decode("best", free=50), decode("other", free=20, total=30)
    picker = picker_with([], [best, other])
    assert picker.pick_decode(100, avoid={"best"}) is other
    assert picker.pick_decode(100, avoid={"best", "other"}) is best  # all failed it: the best still serves
    assert picker.pick_decode(1000, avoid={"best"}) is best  # 63 blocks: the other could never hold them


def test_a_decode_worker_holding_the_prompt_wins_within_one_running_sequence_of_the_least_loaded():
    """A conversation's next turn goes back to the decode worker that holds its last prompt and answer
    (it pulls only the rest), unless that worker runs more than DECODE_AFFINITY_SLACK sequences more."""
    holder, other = decode("holder", running=1, free=60), decode("other", running=0, free=90)
    picker = picker_with([], [holder, other])
    turn1 = PromptBlocks("m", list(range(100)))
    assert picker.pick_decode(200, prompt=turn1) is other  # nothing held anywhere: the least loaded
    picker.remember_decoded(holder, PromptBlocks("m", list(range(130))))  # turn 1 and its answer
    turn2 = PromptBlocks("m", list(range(130)) + [7] * 40)
    assert picker.decode_cached_tokens(holder, turn2) == 128 and picker.decode_cached_tokens(other, turn2) == 0
    assert picker.pick_decode(200, prompt=turn2) is holder
    assert picker.pick_decode(200) is other  # without the prompt (n > 1): load alone
    busier = decode("holder", running=2, free=60)
    picker._workers["decode"] = [busier, other]
    assert picker.pick_decode(200, prompt=turn2) is other  # two more running: balance first


def test_decode_affinity_ignores_workers_that_keep_no_blocks_and_never_trades_room_for_it():
    keeps_none, roomy = decode("none", caching=False), decode("roomy", running=1)
    picker = picker_with([], [keeps_none, roomy])
    tokens = PromptBlocks("m", list(range(64)))
    picker.remember_decoded(keeps_none, tokens)
    assert picker.decode_cached_tokens(keeps_none, tokens) == 0 and picker.pick_decode(10, prompt=tokens) is keeps_none
    full, free = decode("full", free=2), decode("free", running=1)
    picker = picker_with([], [full, free])
    picker.remember_decoded(full, tokens)
    assert picker.pick_decode(100, prompt=tokens) is free  # 7 blocks: only "free" has them now


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
    with picker.track_prompt(idle, 600):
        assert picker.pick_colocated(num_tokens=100) is busy
    assert picker.pick_colocated(num_tokens=5000) is None


def test_mixed_fleet_prefers_the_less_loaded_kind_and_ties_go_to_the_pair():
    pair = WorkerRecord("p", "prefill", "p:1", load={"outstanding_tokens": 100})
    picker = picker_with([pair], [decode("d")], [colocated("c", outstanding=100)])
    both = picker.workers("colocated")[0], pair
    assert not picker.prefers_colocated(*both)
    with picker.track_prompt(pair, 1):
        assert picker.prefers_colocated(*both)
    assert picker.prefers_colocated(both[0], None) and not picker.prefers_colocated(None, pair)


def spill_record(worker_id: str, outstanding: int = 0, decode_left: int = 0, prefill_s: float = 0.0,
                 decode_s: float = 0.0, total: int = 100):
    load = {"outstanding_tokens": outstanding, "decode_tokens_left": decode_left, "prefill_s_per_token": prefill_s,
            "decode_s_per_token": decode_s, "total_blocks": total, "block_size": 16, "spill_only": 1}
    return WorkerRecord(worker_id, "colocated", f"{worker_id}:1", load=load)


def spill_fleet(prefill_outstanding: int = 0, decode_running: int = 0, policy: SpillPolicy = SpillPolicy(1024, 32),
                spill: list[WorkerRecord] | None = None) -> WorkerPicker:
    """One prefill/decode pair whose workers also registered spill-only colocated records."""
    prefill = WorkerRecord("p", "prefill", "p:1", load={"outstanding_tokens": prefill_outstanding},
                           kv_format="2x2x16:float32")
    picker = WorkerPicker(registry=None, suspect_s=5.0, spill=policy)
    spill = spill if spill is not None else [spill_record("p", prefill_outstanding), spill_record("d")]
    picker._workers = {"prefill": [prefill], "decode": [decode("d", running=decode_running)], "colocated": spill}
    return picker


def test_spill_only_workers_take_nothing_while_the_pair_has_room():
    picker = spill_fleet(prefill_outstanding=1000, decode_running=31)
    assert not picker.pairs_saturated(100, 200)
    assert picker.pick_spill(100, 200) is None
    assert picker.pick_colocated(200) is None  # spill-only records are never dedicated colocated workers


def test_a_long_prompt_queue_or_a_full_decode_batch_saturates_the_pair():
    assert spill_fleet(prefill_outstanding=1024).pairs_saturated(100, 200)
    assert spill_fleet(decode_running=32).pairs_saturated(100, 200)
    in_flight = spill_fleet(prefill_outstanding=1000)
    with in_flight.track_prompt(in_flight.workers("prefill")[0], 1000):  # the report and the router's count overlap
        assert not in_flight.pairs_saturated(100, 200)
    with in_flight.track_prompt(in_flight.workers("prefill")[0], 1024):  # sent since the last report
        assert in_flight.pairs_saturated(100, 200)
    never = spill_fleet(prefill_outstanding=10**6, decode_running=10**3, policy=SpillPolicy(0, 0))
    assert not never.pairs_saturated(100, 200)


def test_a_pair_without_a_decode_worker_able_to_take_the_request_counts_as_saturated():
    picker = spill_fleet(spill=[spill_record("p", total=1000)])
    assert picker.pairs_saturated(100, 100 * 16 + 1)  # the decode worker holds 100 blocks: never this request
    assert picker.pick_spill(100, 100 * 16 + 1).worker_id == "p"


def test_spill_goes_to_the_worker_expected_to_be_free_first():
    # both sides saturated; p: 2000 queued prompt tokens at 0.1 ms = 0.2 s; d: 600 decode tokens at 1 ms = 0.6 s
    spill = [spill_record("p", outstanding=2000, prefill_s=1e-4, decode_s=1e-3),
             spill_record("d", decode_left=600, prefill_s=1e-4, decode_s=1e-3)]
    picker = spill_fleet(prefill_outstanding=2000, decode_running=32, spill=spill)
    assert picker.busy_seconds(spill) == {"p": 2000 * 1e-4, "d": 600 * 1e-3}
    assert picker.pick_spill(100, 200).worker_id == "p"
    with picker.track_decode(spill[0], 500):  # 0.5 s more decoding sent to p since its report
        assert picker.pick_spill(100, 200).worker_id == "d"


def test_past_one_mark_spill_goes_to_a_half_of_the_other_side():
    # the prefill worker's half would queue behind the same prompts, on the same core; the decode
    # worker's half would add to the full batch it runs
    p = spill_record("p", outstanding=2000, prefill_s=1e-4, decode_s=1e-3)  # 0.2 s of prompts
    d = spill_record("d", decode_left=600, prefill_s=1e-4, decode_s=1e-3)  # 0.6 s of decoding
    prompts_queue = spill_fleet(prefill_outstanding=2000, spill=[p, d])
    assert prompts_queue.saturated_sides(100, 200) == {"prefill"}
    assert prompts_queue.pick_spill(100, 200).worker_id == "d"
    assert spill_fleet(prefill_outstanding=2000, spill=[p]).pick_spill(100, 200) is None
    idle_p = spill_record("p", prefill_s=1e-4, decode_s=1e-3)
    batch_full = spill_fleet(decode_running=32, spill=[idle_p, d])
    assert batch_full.saturated_sides(100, 200) == {"decode"}
    assert batch_full.pick_spill(100, 200).worker_id == "p"
    assert spill_fleet(decode_running=32, spill=[d]).pick_spill(100, 200) is None


def test_past_the_prompt_mark_a_decode_workers_half_queues_one_prompt_at_a_time_but_in_a_long_burst():
    d = spill_record("d", decode_left=100, prefill_s=1e-4, decode_s=1e-3)
    picker = spill_fleet(prefill_outstanding=2000, spill=[spill_record("p", outstanding=2000), d])
    with picker.track_prompt(d, 256):  # a spilled prompt not prefilled yet
        assert picker.pick_spill(256, 512) is None
    assert picker.pick_spill(256, 512).worker_id == "d"
    reported = spill_record("d", outstanding=1024, decode_left=100, prefill_s=1e-4, decode_s=1e-3)
    assert spill_fleet(prefill_outstanding=4095, spill=[reported]).pick_spill(256, 512) is None
    long_burst = spill_fleet(prefill_outstanding=4096, spill=[spill_record("p", outstanding=4096), reported])
    assert long_burst.pick_spill(256, 512).worker_id == "d"  # a burst: still not the prefill worker's half
    both = spill_fleet(prefill_outstanding=2000, decode_running=32, spill=[reported])
    assert both.pick_spill(256, 512).worker_id == "d"  # past both marks: the one free first, as ever


def test_the_burst_length_is_its_own_figure_not_a_multiple_of_the_prompt_mark():
    reported = spill_record("d", outstanding=256, decode_left=100, prefill_s=1e-4, decode_s=1e-3)
    low_mark = SpillPolicy(prefill_tokens=256, decode_running=32, burst_tokens=4096)
    short = spill_fleet(prefill_outstanding=1024, policy=low_mark, spill=[spill_record("p", outstanding=1024), reported])
    assert short.saturated_sides(256, 512) == {"prefill"}
    assert short.pick_spill(256, 512) is None  # 4x the mark, but short of the burst: one spilled prompt at a time
    burst = spill_fleet(prefill_outstanding=4096, policy=low_mark, spill=[reported])
    assert burst.pick_spill(256, 512).worker_id == "d"
    never = spill_fleet(prefill_outstanding=10**6, policy=SpillPolicy(256, 32, burst_tokens=0), spill=[reported])
    assert never.pick_spill(256, 512) is None


def test_decode_tokens_are_priced_alike_on_every_spill_only_worker():
    # p measured decoding at batch ~1 (7 ms a token), d at a larger batch (1.5 ms): one more sequence
    # costs both about the same, so both are priced at the cheapest reading; prompts at their own
    spill = [spill_record("p", outstanding=100, decode_left=64, prefill_s=2e-4, decode_s=7e-3),
             spill_record("d", outstanding=100, decode_left=64, prefill_s=1e-4, decode_s=1.5e-3)]
    busy = spill_fleet(spill=spill).busy_seconds(spill)
    assert busy == {"p": pytest.approx(100 * 2e-4 + 64 * 1.5e-3), "d": pytest.approx(100 * 1e-4 + 64 * 1.5e-3)}


def test_a_worker_without_measured_costs_is_taken_as_the_costliest_measured():
    spill = [spill_record("p", outstanding=100, prefill_s=2e-4, decode_s=1e-3), spill_record("d", outstanding=100)]
    busy = spill_fleet(spill=spill).busy_seconds(spill)
    assert busy["d"] == busy["p"] == 100 * 2e-4
    unmeasured = [spill_record("p", outstanding=3), spill_record("d", decode_left=2)]
    assert spill_fleet(spill=unmeasured).busy_seconds(unmeasured) == {"p": 3.0, "d": 2.0}  # 1 s per token


def test_in_flight_decode_tokens_count_until_the_block_ends():
    picker = spill_fleet()
    d = picker.workers("colocated")[1]
    with picker.track_decode(d, 64):
        assert picker.busy_seconds([d]) == {"d": 64.0}
    assert picker.busy_seconds([d]) == {"d": 0.0}


async def test_spilling_is_announced_in_the_registry_at_most_every_quarter_second(monkeypatch):
    marks = []

    class Registry:
        async def mark_spilling(self, hold_s):
            marks.append(hold_s)

    clock = [100.0]
    monkeypatch.setattr("services.router.picker.time.monotonic", lambda: clock[0])
    picker = WorkerPicker(registry=Registry(), suspect_s=5.0)
    await picker.announce_spill()
    await picker.announce_spill()
    clock[0] += 0.25
    await picker.announce_spill()
    assert marks == [1.0, 1.0]


def test_a_prompt_spilled_to_a_decode_worker_is_no_open_stream_there():
    # the decode worker's spill-only record shares its worker id: a 256-token prompt in flight on it
    # must not read as 256 open decode streams (which would saturate the pair), and streams not as prompt
    picker = spill_fleet()
    d, d_spill = picker.workers("decode")[0], picker.workers("colocated")[1]
    with picker.track_prompt(d_spill, 256):
        assert not picker.pairs_saturated(100, 200)
        assert picker.busy_seconds([d_spill]) == {"d": 256.0}  # unmeasured: 1 s per token
    with picker.track_stream(d):
        assert picker.busy_seconds([d_spill]) == {"d": 0.0}
        with picker.track_stream(d):
            assert picker.pick_decode(200) is d


def test_open_streams_count_toward_the_decode_mark():
    picker = spill_fleet(decode_running=30)
    d = picker.workers("decode")[0]
    with picker.track_stream(d), picker.track_stream(d):  # the report and the router's count overlap
        assert not picker.pairs_saturated(100, 200)
    with contextlib.ExitStack() as streams:
        for _ in range(32):
            streams.enter_context(picker.track_stream(d))
        assert picker.pairs_saturated(100, 200)  # opened since the last report


def caching_prefill(worker_id: str, outstanding: int = 0, capacity: int = 1000) -> WorkerRecord:
    load = {"outstanding_tokens": outstanding, "prefix_block_size": 16, "prefix_cache_blocks": capacity}
    return WorkerRecord(worker_id, "prefill", f"{worker_id}:1", load=load)


def test_prefill_goes_where_the_prompt_is_cached_unless_the_queue_there_outweighs_it():
    a, b = caching_prefill("a"), caching_prefill("b", outstanding=10)
    picker = picker_with([a, b], [])
    prompt = PromptBlocks("m", list(range(1024)))
    assert picker.pick_prefill(1024, prompt) is a  # nothing cached anywhere: least loaded
    picker.remember(b, prompt)
    assert picker.cached_tokens(b, prompt) == 1024 and picker.cached_tokens(a, prompt) == 0
    assert picker.pick_prefill(1024, prompt) is b  # 10 queued + 0 uncached beats 0 + 1024
    with picker.track_prompt(b, 2000):
        assert picker.pick_prefill(1024, prompt) is a
    follow_up = PromptBlocks("m", list(range(1024)) + [7] * 100)  # the next turn: the same head, then more
    assert picker.cached_tokens(b, follow_up) == 1024
    salted = PromptBlocks("m", list(range(1024)), cache_salt="tenant")
    assert picker.cached_tokens(b, salted) == 0


def test_a_worker_that_caches_nothing_is_never_expected_to_hit():
    plain = WorkerRecord("p", "prefill", "p:1", load={"outstanding_tokens": 0})
    picker = picker_with([plain], [])
    prompt = PromptBlocks("m", list(range(64)))
    picker.remember(plain, prompt)
    assert picker.cached_tokens(plain, prompt) == 0


def test_a_spilled_prompt_goes_to_the_half_that_has_it_cached_when_that_saves_more_than_its_queue_costs():
    # both sides saturated; p: 500 queued prompt tokens at 0.1 ms; d: nothing queued, the prompt not cached
    spill = [spill_record("p", outstanding=500, prefill_s=1e-4, decode_s=1e-3),
             spill_record("d", prefill_s=1e-4, decode_s=1e-3)]
    for record in spill:
        record.load.update(prefix_block_size=16, prefix_cache_blocks=1000)
    picker = spill_fleet(prefill_outstanding=2000, decode_running=32, spill=spill)
    prompt = PromptBlocks("m", list(range(1024)))
    assert picker.pick_spill(1024, 1100, prompt).worker_id == "d"
    picker.remember(spill[0], prompt)  # p has the prompt's 1024 tokens cached: 500 queued - 1024 saved
    assert picker.busy_seconds(spill, prompt)["p"] == pytest.approx((500 - 1024) * 1e-4)
    assert picker.pick_spill(1024, 1100, prompt).worker_id == "p"


async def test_a_watched_worker_whose_lease_lapses_is_signalled_and_a_draining_one_is_not():
    import asyncio

    class Registry:
        lapsed: set[str] = set()

        async def snapshot(self, roles):
            return RegistrySnapshot("e1", {role: [] for role in roles}, set(self.lapsed))

    registry = Registry()
    picker = WorkerPicker(registry=registry, suspect_s=5.0)
    hung, draining = WorkerRecord("p-hung", "prefill", "h:1"), WorkerRecord("p-draining", "prefill", "d:1")
    with picker.watch_lapse(hung) as hung_lapsed, picker.watch_lapse(draining) as draining_lapsed:
        await picker.refresh()  # both gone from the live list; neither lapsed yet
        assert not hung_lapsed.is_set() and not draining_lapsed.is_set()
        registry.lapsed = {"p-hung"}  # its lease ran out; the draining one deregistered instead
        await picker.refresh()
        await asyncio.wait_for(hung_lapsed.wait(), 1)
        assert not draining_lapsed.is_set()
    assert not picker._lapse_watchers, "watches end with their blocks"


class EpochRegistry:
    """A registry whose listed workers and data epoch a test sets."""

    def __init__(self):
        self.epoch, self.listed = "e1", {"prefill": [], "decode": [], "colocated": []}

    async def snapshot(self, roles):
        return RegistrySnapshot(self.epoch, {role: list(self.listed[role]) for role in roles}, set())


async def test_workers_are_kept_while_they_register_again_after_redis_lost_its_data(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("services.router.picker.time.monotonic", lambda: clock[0])
    registry = EpochRegistry()
    p1, p2, d1 = (WorkerRecord("p1", "prefill", "a:1"), WorkerRecord("p2", "prefill", "a:2"),
                  WorkerRecord("d1", "decode", "b:1"))
    registry.listed.update(prefill=[p1, p2], decode=[d1])
    picker = WorkerPicker(registry=registry, suspect_s=5.0)
    await picker.refresh()
    registry.epoch, registry.listed = "e2", {"prefill": [], "decode": [], "colocated": []}  # Redis restarted
    await picker.refresh()
    assert [w.worker_id for w in picker.workers("prefill")] == ["p1", "p2"]
    assert [w.worker_id for w in picker.workers("decode")] == ["d1"]
    p1_again = WorkerRecord("p1", "prefill", "a:1", load={"num_running": 3})
    registry.listed["prefill"] = [p1_again]  # its next heartbeat
    await picker.refresh()
    assert picker.workers("prefill") == [p1_again, p2]  # the fresh record, once, and the one not back yet
    clock[0] += 10.0
    await picker.refresh()
    assert picker.workers("prefill") == [p1_again] and picker.workers("decode") == []


async def test_with_redis_data_intact_a_worker_that_leaves_is_gone_at_once():
    registry = EpochRegistry()
    registry.listed["prefill"] = [WorkerRecord("p1", "prefill", "a:1")]
    picker = WorkerPicker(registry=registry, suspect_s=5.0)
    await picker.refresh()
    registry.listed["prefill"] = []  # deregistered (drained)
    await picker.refresh()
    assert picker.workers("prefill") == []


def test_a_chats_next_turn_is_prefilled_on_the_half_of_the_decode_worker_holding_its_last_turn():
    """The decode worker holds turn 1's prompt and answer (1000 tokens); prefill workers hold at most
    the prompt (800): its half prefills turn 2 computing only the new tokens."""
    halves = [spill_record("p"), spill_record("d", total=1000)]
    picker = spill_fleet(spill=halves)
    picker._workers["prefill"] = [caching_prefill("p")]
    turn1, turn1_and_answer = list(range(800)), list(range(1000))
    turn2 = PromptBlocks("m", turn1_and_answer + [7] * 50)
    assert picker.pick_prefix_spill(1050, 1100, turn2) is None  # nothing held anywhere
    picker.remember(picker.workers("prefill")[0], PromptBlocks("m", turn1))
    picker.remember_conversation(halves[1], PromptBlocks("m", turn1_and_answer))  # d's spill half finished it
    half, held = picker.pick_prefix_spill(1050, 1100, turn2)
    assert half is halves[1] and held == 992  # 62 full blocks
    with picker.track_prompt(halves[1], 100):  # a prompt queued there already: not this one too
        assert picker.pick_prefix_spill(1050, 1100, turn2) is None
    assert picker.pick_prefix_spill(1050, 1100, None) is None


def test_no_prefix_spill_where_it_saves_little_or_leaves_more_to_compute_than_it_saves():
    halves = [spill_record("p"), spill_record("d", total=1000)]
    picker = spill_fleet(spill=halves)
    picker._workers["prefill"] = [caching_prefill("p")]
    picker.remember_decoded(picker.workers("decode")[0], PromptBlocks("m", list(range(200))))
    picker.remember(picker.workers("prefill")[0], PromptBlocks("m", list(range(160))))
    assert picker.pick_prefix_spill(230, 300, PromptBlocks("m", list(range(230)))) is None  # saves 32 < 64
    picker.remember(picker.workers("prefill")[0], PromptBlocks("m", [9] * 16))  # nothing in common
    long_tail = PromptBlocks("m", list(range(200)) + [5] * 300)  # saves 192 of 500; 308 left to compute
    picker._workers["prefill"] = [caching_prefill("q")]
    assert picker.pick_prefix_spill(500, 600, long_tail) is None


def test_a_finished_colocated_stream_is_remembered_where_its_blocks_stay():
    dedicated = colocated("c")
    dedicated.load.update(prefix_block_size=16, prefix_cache_blocks=1000)
    picker = picker_with([], [], [dedicated])
    chat = PromptBlocks("m", list(range(64)))
    picker.remember_conversation(dedicated, chat)
    assert picker.cached_tokens(dedicated, chat) == 64
