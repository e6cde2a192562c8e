"""The discrete-event simulator against closed forms and against the real engine's policies."""

from __future__ import annotations

import random

import pytest

from distserve.planner.profile import Profile
from distserve.planner.sim_metrics import Slo
from distserve.planner.sim_workers import MAX_SKIPS, SimRequest, take_prefill_batch, take_whole_prompts
from distserve.planner.simulator import ClusterConfig, Request, WorkerSpec, simulate


def toy_profile(coeffs=(0.01, 1e-4, 1e-8, 2e-4), kv_capacity_tokens=1 << 20, max_batch_tokens=512,
                transfer=(0.002, 1e9), kv_bytes_per_token=1000, cores=1) -> Profile:
    return Profile(model="toy", dtype="float32", device="cpu", cores_per_worker=cores,
                   kv_bytes_per_token=kv_bytes_per_token, kv_capacity_tokens=kv_capacity_tokens,
                   max_batch_tokens=max_batch_tokens, step_coeffs=coeffs, transfer_latency_s=transfer[0],
                   transfer_bytes_per_s=transfer[1])


def fleet(*roles: str, profile: Profile | None = None, **spec) -> ClusterConfig:
    profile = profile or toy_profile()
    return ClusterConfig(tuple(WorkerSpec(role, profile, **spec) for role in roles))


def poisson(rate: float, num: int, seed: int = 0) -> list[float]:
    rng, t, times = random.Random(seed), 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_prefill_queue_matches_md1(rho):
    """One prefill worker whose budget is one prompt: an M/D/1 queue with S = prefill_time."""
    length = 256
    profile = toy_profile(max_batch_tokens=length)
    service = profile.prefill_time([(length, 0)])
    requests = [Request(t, length, 1) for t in poisson(rho / service, 20_000, seed=1)]
    result = simulate(fleet("prefill", profile=profile), requests)
    mean_wait = sum(r.ttft_s for r in result.results) / len(requests) - service
    expected = rho * service / (2 * (1 - rho))  # Pollaczek-Khinchine, deterministic service
    assert mean_wait == pytest.approx(expected, rel=0.05)


def test_prefill_without_overlap_never_waits():
    """D/D/1 with gaps longer than the service time: every TTFT is exactly the service time."""
    profile = toy_profile(max_batch_tokens=300)
    service = profile.prefill_time([(300, 0)])
    requests = [Request(i * service * 1.5, 300, 1) for i in range(100)]
    result = simulate(fleet("prefill", profile=profile), requests)
    assert all(r.ttft_s == pytest.approx(service, abs=1e-12) for r in result.results)


def test_lone_decode_tpot_is_mean_step_time():
    input_len, output_len = 100, 20
    profile = toy_profile()
    result = simulate(fleet("decode", profile=profile), [Request(0.0, input_len, output_len)])
    steps = [profile.decode_time([input_len + k]) for k in range(output_len - 1)]
    assert result.results[0].ttft_s == 0.0
    assert result.results[0].tpot_s == pytest.approx(sum(steps) / len(steps), rel=1e-12)


def test_lone_request_through_prefill_transfer_and_decode():
    input_len, output_len = 300, 10
    profile = toy_profile()
    result = simulate(fleet("prefill", "decode", profile=profile), [Request(1.0, input_len, output_len)]).results[0]
    prefill = profile.prefill_time([(input_len, 0)])
    transfer = profile.transfer_time(input_len * profile.kv_bytes_per_token)
    decode = sum(profile.decode_time([input_len + k]) for k in range(output_len - 1))
    assert result.ttft_s == pytest.approx(prefill)
    assert result.tpot_s == pytest.approx((transfer + decode) / (output_len - 1))
    assert result.e2e_s == pytest.approx(prefill + transfer + decode)


def test_long_prompt_is_chunked_at_growing_positions():
    profile = toy_profile(max_batch_tokens=256)
    result = simulate(fleet("prefill", profile=profile), [Request(0.0, 600, 1)]).results[0]
    chunks = [[(256, 0)], [(256, 256)], [(88, 512)]]
    assert result.ttft_s == pytest.approx(sum(profile.prefill_time(c) for c in chunks))


def test_take_batch_mirrors_prefill_batcher():
    waiting = [SimRequest(0, 0.0, 400, 1), SimRequest(1, 0.0, 100, 1), SimRequest(2, 0.0, 300, 1)]
    batch = take_prefill_batch(waiting, 512)
    assert [(r.index, n) for r, n in batch] == [(0, 400), (1, 100), (2, 12)]  # fits first, then a chunk
    assert [r.index for r in waiting] == [2]
    starving = [SimRequest(0, 0.0, 1000, 1), SimRequest(1, 0.0, 500, 1)]
    starving[0].num_skipped = MAX_SKIPS
    assert [(r.index, n) for r, n in take_prefill_batch(starving, 512)] == [(0, 512)]
    assert starving[1].num_skipped == 1


def test_max_skips_matches_the_engine():
    from distserve.engine import prefill_batcher

    assert MAX_SKIPS == prefill_batcher.MAX_SKIPS


def test_decode_batch_is_capped_by_max_running():
    """Three lone-equivalent requests with max_running=1 decode one after another."""
    profile = toy_profile(coeffs=(0.01, 0.0, 0.0, 0.0))
    requests = [Request(0.0, 10, 11) for _ in range(3)]
    result = simulate(fleet("decode", profile=profile, max_running=1), requests)
    assert [r.e2e_s for r in result.results] == pytest.approx([0.1, 0.2, 0.3])


def test_decode_waits_for_kv_blocks():
    """Capacity for one request's blocks: the second starts when the first frees them."""
    profile = toy_profile(coeffs=(0.01, 0.0, 0.0, 0.0), kv_capacity_tokens=32)
    requests = [Request(0.0, 10, 11), Request(0.0, 10, 11)]  # 21 tokens -> 2 blocks each of 16
    result = simulate(fleet("decode", profile=profile), requests)
    assert [r.e2e_s for r in result.results] == pytest.approx([0.1, 0.2])


def test_request_too_large_for_any_cache_is_refused():
    profile = toy_profile(kv_capacity_tokens=64)
    result = simulate(fleet("prefill", "decode", profile=profile), [Request(0.0, 100, 10)], Slo(1.0, 1.0))
    assert result.results[0].ttft_s == float("inf") and result.summary.attainment == 0.0


def test_colocated_prefill_shares_steps_with_decode_rows():
    """A lone colocated request: prefill step, then output_len - 1 decode steps."""
    profile = toy_profile()
    result = simulate(fleet("colocated", profile=profile), [Request(0.0, 200, 5)]).results[0]
    assert result.ttft_s == pytest.approx(profile.prefill_time([(200, 0)]))
    decode = [profile.decode_time([200 + k]) for k in range(4)]
    assert result.tpot_s == pytest.approx(sum(decode) / 4)


def test_colocated_decode_rows_ride_on_top_of_the_token_budget():
    """Budget 100 with one sequence decoding: a new 100-token prompt is one step, not 99 tokens then 1."""
    profile = toy_profile(coeffs=(0.0, 1.0, 0.0, 0.0), max_batch_tokens=100)
    requests = [Request(0.0, 10, 100), Request(10.0, 100, 2)]
    result = simulate(fleet("colocated", profile=profile), requests).results[1]
    # it arrives as the first prompt's step ends (10 s); one step of 1 decode row + 100 prompt tokens = 101 s;
    # a budget that counted the row would take 1 + 99 then 1 + 1 tokens: 102 s
    assert result.ttft_s == pytest.approx(101.0)


def test_router_balances_prefill_by_outstanding_tokens():
    profile = toy_profile(max_batch_tokens=4096)
    requests = [Request(0.0, 1000, 1), Request(0.0, 100, 1), Request(0.0, 100, 1)]
    results = simulate(fleet("prefill", "prefill", profile=profile), requests).results
    # 1000 -> worker 0; 100 -> worker 1; the next 100 -> worker 1 (100 < 1000 outstanding)
    assert results[1].ttft_s < results[0].ttft_s and results[2].ttft_s < results[0].ttft_s


def test_simulation_is_deterministic_and_stops_early():
    requests = [Request(t, 300, 50) for t in poisson(40.0, 500)]
    config = fleet("prefill", "decode")
    first, second = simulate(config, requests), simulate(config, requests)
    assert first.results == second.results
    stopped = simulate(config, requests, Slo(0.05, 0.05), stop_below=0.9)
    assert not stopped.summary.is_complete and stopped.summary.attainment < 0.9


def test_fleet_types_agree_when_unloaded():
    """At a trickle all three fleet types serve a lone request in about the same time."""
    requests = [Request(100.0 * i, 200, 20) for i in range(5)]
    for config in (fleet("prefill", "decode"), fleet("colocated"), fleet("prefill", "decode", "colocated")):
        assert simulate(config, requests, Slo(1.0, 0.1)).summary.attainment == 1.0


def test_front_end_cost_is_paid_per_streamed_token_only_when_no_core_of_the_node_is_idle():
    """The OS runs the router, gateway and client on an idle core when there is one."""
    import dataclasses

    frontend = 5e-4
    lone = [Request(0.0, 100, 20)]
    for config, requests, charged in (
            (fleet("prefill", "decode"), lone, False),  # the prefill core idles while the request decodes
            (fleet("colocated"), lone, True),  # no other core
            (fleet("colocated", "colocated"), lone * 2, True)):  # both busy, in step with each other
        plain = simulate(config, requests).results
        loaded = simulate(dataclasses.replace(config, frontend_s_per_token=frontend), requests).results
        for before, after in zip(plain, loaded):
            assert after.ttft_s == pytest.approx(before.ttft_s)  # prefill steps stream nothing
            # each of the output_len - 1 decode steps, one decoding row per worker
            assert after.tpot_s == pytest.approx(before.tpot_s + (frontend if charged else 0.0))

def test_whole_prompts_are_taken_in_arrival_order_until_one_does_not_fit():
    waiting = [SimRequest(i, 0.0, n, 5) for i, n in enumerate([300, 150, 100, 10])]
    batch = take_whole_prompts(waiting, 500, max_prompts=10)
    assert [(r.index, n) for r, n in batch] == [(0, 300), (1, 150)]  # 100 would overrun; 10 waits behind it
    assert [r.index for r in waiting] == [2, 3]
    assert [r.index for r, _ in take_whole_prompts(waiting, 500, max_prompts=1)] == [2]
    lone = [SimRequest(9, 0.0, 900, 5)]
    assert [(r.index, n) for r, n in take_whole_prompts(lone, 500, 10)] == [(9, 900)]  # a long prompt runs alone


def test_without_chunked_prefill_no_more_prompts_are_prefilled_than_may_decode():
    """max_running 1: the second prompt waits for the first sequence to finish, as vLLM's max_num_seqs."""
    profile = toy_profile(coeffs=(0.0, 1.0, 0.0, 0.0), max_batch_tokens=100)
    requests = [Request(0.0, 10, 3), Request(0.0, 20, 2)]
    results = simulate(fleet("colocated", profile=profile, chunked_prefill=False, max_running=1), requests).results
    # prefill 10 (0-10), two decode steps of one row (10-12), then the second prompt's 20 (12-32)
    assert results[0].ttft_s == pytest.approx(10.0) and results[1].ttft_s == pytest.approx(32.0)


def test_without_chunked_prefill_decode_rows_wait_for_a_whole_prompt():
    """Unit costs per token: a decoding sequence stalls for the whole 100-token prefill step, where with
    chunked prefill (budget 100) it rides on the same step."""
    profile = toy_profile(coeffs=(0.0, 1.0, 0.0, 0.0), max_batch_tokens=100)
    requests = [Request(0.0, 10, 4), Request(10.0, 100, 2)]
    whole = simulate(fleet("colocated", profile=profile, chunked_prefill=False), requests).results
    chunked = simulate(fleet("colocated", profile=profile), requests).results
    # steps without chunking: prefill 10 (0-10), prefill 100 (10-110), then the first request's 3 decode
    # rows share steps with the second's 1: 2 + 1 + 1 s. Chunked: 10, then 1 row + 100 tokens (10-111), ...
    assert whole[1].ttft_s == pytest.approx(100.0) and chunked[1].ttft_s == pytest.approx(101.0)
    assert whole[0].tpot_s == pytest.approx((110 - 10 + 2 + 1 + 1) / 3)
    assert chunked[0].tpot_s == pytest.approx((101 + 2 + 1) / 3)
