"""The placement search, its rate search, fleet strings, placement, and the `distserve plan` CLI."""

from __future__ import annotations

import json

import pytest

from distserve.planner import plan_cli
from distserve.planner.fleet_spec import format_workers, parse_workers
from distserve.planner.goodput import RateSearch, Trace, Workload, find_goodput, run_config
from distserve.planner.placement import DeviceBudget, place
from distserve.planner.search import SearchSpace, enumerate_candidates, plan
from distserve.planner.sim_metrics import Slo
from distserve.planner.simulator import ClusterConfig, simulate
from tests.unit.test_simulator import toy_profile


def test_prefill_bound_workload_picks_two_prefill_one_decode():
    """Prefill is expensive (0.2 ms/token: a 500-token prompt takes 101 ms, so one prefill worker
    serves at most 9.9 prompts/s) and decode cheap (1 ms + 0.2 ms per sequence per step, far
    inside the 5 ms TPOT target). On 3 cores: any fleet with one prefill worker is capped at
    9.9 req/s (1p2d: 3.3 per core, 1p1d: 4.95), while 2p1d approaches 19.8 (up to 6.6 per core).
    Colocated fleets put 100 ms prompt steps between their decode steps, which breaks the TPOT
    target once prompts arrive often, so they fall below 2p1d as well."""
    profile = toy_profile(coeffs=(1e-3, 2e-4, 0.0, 0.0), max_batch_tokens=512)
    trace = Trace.from_lengths([(500, 50)] * 300)
    ranked = plan([profile], DeviceBudget.cores(3), trace, Slo(0.5, 0.005), SearchSpace(budget_factors=(1.0,)))
    by_fleet = {r.candidate.fleet: r for r in ranked}
    best = ranked[0]
    assert best.candidate.fleet == "2p@1:512+1d@1"
    assert 3.3 < best.per_device <= 6.6
    assert by_fleet["1p@1:512+2d@1"].goodput.rate <= 9.9
    best_colocated = max(r.per_device for r in ranked if r.candidate.family == "colocated")
    assert best_colocated < best.per_device


def test_candidates_fit_the_core_budget():
    one, two = toy_profile(cores=1), toy_profile(cores=2)
    fleets = {c.fleet for c in enumerate_candidates([one, two], DeviceBudget.cores(2), SearchSpace(budget_factors=(1.0,)))}
    # 1p@2+1d@1 would need 3 cores; a mixed fleet needs 3 workers
    assert fleets == {"1p@1:512+1d@1", "1c@1:512", "2c@1:512", "1c@2:512"}


def test_gpu_candidates_place_both_ways_and_never_span_nodes():
    profiles = [toy_profile(cores=tp) for tp in (1, 2, 4, 8)]
    budget = DeviceBudget.gpus("2x4", inter_node_bytes_per_s=25e9)
    candidates = enumerate_candidates(profiles, budget, SearchSpace(budget_factors=(1.0,), include_mixed=False))
    assert all(w.devices <= 4 for c in candidates for w in c.config.workers)
    assert all(sum(w.devices for w in c.config.workers if w.node == n) <= 4 for c in candidates for n in (0, 1))
    placements = {c.placement for c in candidates if c.fleet == "2p@2:512+2d@2"}
    assert placements == {"local", "spread"}
    # one prefill and one decode worker of 4 GPUs each cannot share a node: no local placement
    assert {c.placement for c in candidates if c.fleet == "1p@4:512+1d@4"} == {"spread"}


def test_local_placement_pairs_prefill_and_decode_per_node():
    profile = toy_profile(cores=2)
    workers = parse_workers("2p@2+2d@2", [profile])
    budget = DeviceBudget.gpus("2x4", inter_node_bytes_per_s=1e6)
    local, spread = place(workers, budget, "local"), place(workers, budget, "spread")
    assert [w.node for w in local.workers] == [0, 1, 0, 1] and local.is_node_local
    assert [w.node for w in spread.workers] == [0, 0, 1, 1] and not spread.is_node_local
    assert place(parse_workers("3p@2", [profile]), budget) is not None
    assert place(parse_workers("5p@2", [profile]), budget) is None  # 10 GPUs
    # a 1 MB/s inter-node link: spread's transfers cross it (200 KB: +0.2 s), local's never do
    trace = Trace.from_lengths([(200, 10)] * 20)
    requests = trace.at_rate(1.0)
    e2e = {name: simulate(config, requests).summary.e2e_p50_s for name, config in (("local", local), ("spread", spread))}
    assert e2e["spread"] - e2e["local"] == pytest.approx(0.2, abs=0.02)


def test_fleet_strings_round_trip():
    one, two = toy_profile(cores=1), toy_profile(cores=2)
    workers = parse_workers("2p@1:256 + 1d@2", [one, two])
    assert [(w.role, w.devices, w.budget) for w in workers] == [
        ("prefill", 1, 256), ("prefill", 1, 256), ("decode", 2, 512)]
    assert format_workers(workers) == "2p@1:256+1d@2"
    assert format_workers(parse_workers("1p1d1c", [one, two])) == "1p@1:512+1d@1+1c@1:512"
    with pytest.raises(ValueError, match="no profile for 4"):
        parse_workers("1p@4", [one, two])
    with pytest.raises(ValueError, match="cannot read"):
        parse_workers("1p1x", [one])


def test_goodput_search_brackets_the_target():
    config = ClusterConfig(tuple(parse_workers("1p1d", [toy_profile()])))
    trace = Trace.from_lengths([(300, 30)] * 200)
    slo = Slo(0.2, 0.05)
    found = find_goodput(config, trace, slo, RateSearch(rel_tol=0.02))
    assert found.rate > 0 and found.attainment >= 0.9
    failing = [rate for rate, attained in found.probes if attained < 0.9]
    assert min(failing) <= found.rate * 1.02 + 1e-9  # a failing probe lies just above the answer
    looser = find_goodput(config, trace, Slo(0.4, 0.05), RateSearch(rel_tol=0.02))
    assert looser.rate >= found.rate


def test_goodput_is_zero_when_a_lone_request_misses():
    config = ClusterConfig(tuple(parse_workers("1p1d", [toy_profile()])))
    trace = Trace.from_lengths([(300, 30)] * 50)
    assert find_goodput(config, trace, Slo(0.01, 1.0)).rate == 0.0  # a 300-token prefill takes 40 ms


def test_run_config_reports_each_rate():
    trace = Trace.from_lengths([(300, 30)] * 200)
    summaries = run_config([toy_profile()], "1p1d", trace, [1.0, 50.0], Slo(0.2, 0.05))
    assert list(summaries) == [1.0, 50.0]
    assert summaries[1.0].attainment == 1.0 > summaries[50.0].attainment


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "toy.json"
    toy_profile().save(path)
    return str(path)


def test_cli_plans_and_writes_json(profile_path, tmp_path, capsys):
    out = tmp_path / "plan.json"
    status = plan_cli.main(["--profile", profile_path, "--cores", "2", "--workload", "fixed", "--input-len", "200",
                            "--output-len", "20", "--slo-ttft-ms", "500", "--slo-tpot-ms", "50", "--rate", "2",
                            "--num-requests", "100", "--top", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0 and "Best:" in printed and "attain@2/s" in printed
    data = json.loads(out.read_text())
    assert data["best"]["fleet"] == data["candidates"][0]["fleet"] and len(data["candidates"]) == 3
    assert data["best"]["goodput_rps"] > 0
    recommended = printed.split("Recommendation: ")[1].splitlines()
    assert {"disaggregated", "colocated"} <= set(data["recommendation"])  # 2 cores: 1p1d and 2c at least
    best_family = max(data["recommendation"], key=lambda f: data["recommendation"][f]["per_device_rps"])
    assert recommended[0].startswith({"disaggregated": "disaggregate", "colocated": "colocate"}.get(best_family, "mix"))
    for family, choice in data["recommendation"].items():
        misses = choice["misses_past_goodput"]
        assert 0 <= misses["ttft"] <= 1 and 0 <= misses["tpot"] <= 1 and max(misses.values()) > 0.1, family
        assert any(line.strip().startswith(f"{family}: ") and "binds" in line for line in recommended)


def test_cli_simulates_one_fleet(profile_path, capsys):
    status = plan_cli.main(["--profile", profile_path, "--simulate", "1p1d", "--rates", "1,2", "--workload", "fixed",
                            "--input-len", "100-300", "--output-len", "20", "--num-requests", "50"])
    printed = capsys.readouterr().out
    assert status == 0 and "1 req/s" in printed and "2 req/s" in printed


def test_cli_names_a_missing_budget(profile_path, capsys):
    assert plan_cli.main(["--profile", profile_path, "--slo-ttft-ms", "1", "--slo-tpot-ms", "1"]) == 2
    assert "--cores" in capsys.readouterr().out


def test_trace_matches_the_benchmark_and_grows_to_span_the_window():
    from distserve.bench.workload import poisson_arrivals, sample_lengths
    trace = Trace.draw(Workload("chat"), 100, seed=3)
    requests = trace.at_rate(4.0)
    assert [(r.input_len, r.output_len) for r in requests] == sample_lengths("chat", 100, 3)
    assert [r.arrival_s for r in requests] == pytest.approx(poisson_arrivals(4.0, 100, 3))
    pooled = Trace.draw(Workload("chat"), 100, seed=3, pool=5000)
    assert len(pooled.at_rate(4.0)) == 100  # 100 requests already span 10 s at 4/s
    assert len(pooled.at_rate(4.0, min_span_s=100.0)) == 400
    assert len(pooled.at_rate(400.0, min_span_s=100.0)) == 5000  # capped at the pool
