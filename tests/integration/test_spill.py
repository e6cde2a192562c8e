"""Spilling: a prefill/decode pair whose workers also serve whole requests (`distserve up --spill`).

The router keeps requests on the pair while it has room and sends whole requests to either worker's
colocated half once it is saturated; here saturation is set to one request, so a burst spills. Output
stays token-exact against transformers whichever path a request took, and both halves end clean.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time

import grpc
import pytest
import redis

from distserve.engine.model_loader import load_model
from distserve.launcher import Cluster, ClusterSpec
from distserve.v1 import colocated_pb2, colocated_pb2_grpc
from tests.builders import compare_with_tolerance, generate, reference_generate, sampling, token_request
from tests.integration.conftest import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, leftover_state, wait_for_workers
from tests.integration.test_correctness import MAX_TOKENS, make_prompts


@pytest.fixture(scope="module")
def spilling(tiny_model_path, tmp_path_factory):
    free_ports = {f.name: 0 for f in dataclasses.fields(ClusterSpec) if f.name.endswith("_port")}
    spec = ClusterSpec(model=tiny_model_path, num_prefill=1, num_decode=1, spill=True, **free_ports,
                       log_dir=str(tmp_path_factory.mktemp("spill-logs")),
                       prefill_args=PREFILL_TEST_ARGS + ["--colocated-kv-cache-mb", "64"],
                       decode_args=DECODE_TEST_ARGS + ["--max-batch-tokens", "256"],
                       # saturated as soon as the decode worker has one sequence
                       env={"DISTSERVE_DTYPE": "float32", "DISTSERVE_ROUTER_SPILL_DECODE_RUNNING": "1"})
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 1, 1, num_colocated=2)  # each worker registers its spill-only half too
    yield cluster
    cluster.stop()


def colocated_used_blocks(cluster: Cluster) -> dict[str, int]:
    """Used KV blocks of each worker's colocated half (the prefill worker's is its own cache)."""
    used = {}
    for name in ("prefill-0", "decode-0"):
        with grpc.insecure_channel(cluster.processes[name].address) as channel:
            stats = colocated_pb2_grpc.ColocatedServiceStub(channel).GetColocatedStats(
                colocated_pb2.GetColocatedStatsRequest(), timeout=10)
        used[name] = stats.num_used_blocks
    return used


@pytest.fixture(autouse=True)
def spilling_is_clean_after(spilling):
    yield
    deadline = time.monotonic() + 5
    while any(v for v in leftover_state(spilling).values()) or any(colocated_used_blocks(spilling).values()):
        assert time.monotonic() < deadline, (leftover_state(spilling), colocated_used_blocks(spilling))
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference_model(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cpu")


def test_spill_records_name_the_pair_workers_and_are_spill_only(spilling):
    client = redis.Redis.from_url(spilling.redis_url)
    records = [json.loads(client.get(key)) for key in client.keys("distserve:worker:colocated:*")]
    assert sorted(r["worker_id"].split("-")[0] for r in records) == ["decode", "prefill"]
    assert all(r["load"]["spill_only"] == 1 and r["load"]["total_blocks"] > 0 for r in records)


def test_a_burst_spills_to_both_kinds_of_path_and_stays_token_exact(spilling, reference_model):
    prompts = make_prompts(reference_model.config.vocab_size)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(
            lambda p: generate(spilling.router_address, token_request(p, max_tokens=MAX_TOKENS)), prompts))
    routes = [(a.messages[0].prefill_worker, a.messages[0].decode_worker) for a in answers]
    assert any(p == d for p, d in routes), routes  # spilled: one worker prefilled and decoded
    assert any(p != d for p, d in routes), routes  # the first request found the pair with room
    mismatches = []
    for prompt, answer in zip(prompts, answers):
        ok, _ = compare_with_tolerance(answer.token_ids, reference_generate(reference_model, prompt, MAX_TOKENS))
        if not ok:
            mismatches.append((len(prompt), answer.messages[0].prefill_worker, answer.token_ids))
        assert len(answer.token_ids) == MAX_TOKENS
    assert not mismatches, mismatches


@pytest.mark.parametrize("name", ["prefill-0", "decode-0"])
def test_each_worker_serves_a_whole_request_itself(spilling, reference_model, name):
    prompt = make_prompts(reference_model.config.vocab_size)[1]
    with grpc.insecure_channel(spilling.processes[name].address) as channel:
        stub = colocated_pb2_grpc.ColocatedServiceStub(channel)
        responses = list(stub.PrefillAndDecode(colocated_pb2.PrefillAndDecodeRequest(
            request_id=f"direct-{name}", prompt_token_ids=prompt, sampling=sampling(max_tokens=MAX_TOKENS)),
            timeout=120))
    tokens = [t for r in responses for t in r.token_ids]
    ok, _ = compare_with_tolerance(tokens, reference_generate(reference_model, prompt, MAX_TOKENS))
    assert ok, (name, tokens)


def test_a_chats_next_turn_is_prefilled_on_the_decode_worker_holding_its_last_turn_and_answer(spilling,
                                                                                              reference_model):
    """Turn 1 runs on the pair; its decode worker keeps the prompt and the answer. Turn 2 (turn 1, the
    answer, a new message) goes whole to that worker's half, which copies what it holds from its paged
    cache and computes only the rest: no prefill worker ever computed the answer. Token-exact."""
    vocab = reference_model.config.vocab_size
    turn1 = make_prompts(vocab)[0][:40]
    answer1 = generate(spilling.router_address, token_request(turn1, max_tokens=120, ignore_eos=True))
    assert answer1.messages[0].prefill_worker != answer1.messages[0].decode_worker  # the pair, not spilled
    turn2 = turn1 + answer1.token_ids + make_prompts(vocab)[1][:25]
    answer2 = generate(spilling.router_address, token_request(turn2, max_tokens=MAX_TOKENS))
    decode_worker = answer1.messages[0].decode_worker
    assert (answer2.messages[0].prefill_worker, answer2.messages[0].decode_worker) == (decode_worker, decode_worker)
    assert answer2.last.usage.cached_tokens == (len(turn1) + len(answer1.token_ids) - 1) // 16 * 16
    ok, _ = compare_with_tolerance(answer2.token_ids, reference_generate(reference_model, turn2, MAX_TOKENS))
    assert ok, answer2.token_ids
