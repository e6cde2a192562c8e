"""Prefix caching through the whole system on a 1 prefill + 1 decode fleet: prompts that share full
blocks with earlier ones compute only the rest, and greedy output stays token-exact against
transformers (fp32). Every test asserts the hit itself (usage.cached_tokens), so a cache that never
hits fails here."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
import torch

from distserve.engine.model_loader import load_model
from distserve.launcher import Cluster, ClusterSpec
from distserve.prefix_events import PAGED_CACHE, PREFILL_CACHE, STORED, STREAM_KEY, parse_entry
from tests.builders import compare_with_tolerance, generate, reference_generate, token_request
from tests.integration.test_metrics import scrape
from tests.integration.conftest import DECODE_TEST_ARGS, PREFILL_TEST_ARGS, assert_clean, wait_for_workers

BLOCK = 16  # the default prefix_block_size
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def fleet(tiny_model_path, tmp_path_factory):
    free_ports = {f.name: 0 for f in dataclasses.fields(ClusterSpec) if f.name.endswith("_port")}
    spec = ClusterSpec(model=tiny_model_path, num_prefill=1, num_decode=1, num_routers=2, **free_ports,
                       log_dir=str(tmp_path_factory.mktemp("prefix-logs")),
                       prefill_args=PREFILL_TEST_ARGS, decode_args=DECODE_TEST_ARGS,
                       env={"DISTSERVE_DTYPE": "float32"})
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 1, 1)
    yield cluster
    assert_clean(cluster)
    cluster.stop()


@pytest.fixture(scope="module")
def reference_model(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cpu")


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def routed_expecting(fleet, request_id: str, field: str = "expected_cached", router: str = "router") -> int:
    """The cached tokens the router expected on the prefill worker it routed request_id to (its route log
    line); field="decode_expected_cached": on the decode worker."""
    for line in (Path(fleet.spec.log_dir) / f"{router}.log").read_text().splitlines():
        if f"route request_id={request_id} " in line:
            return int(line.split(f" {field}=", 1)[1].split()[0])
    raise AssertionError(f"no route logged for {request_id}")


def assert_exact(answer, prompt, reference_model, max_tokens=MAX_TOKENS):
    ok, _ = compare_with_tolerance(answer.token_ids, reference_generate(reference_model, prompt, max_tokens))
    assert ok, (len(prompt), answer.token_ids)


def test_a_shared_prefix_is_computed_once(fleet, reference_model):
    vocab = reference_model.config.vocab_size
    system = random_tokens(5 * BLOCK + 3, seed=1, vocab=vocab)
    first = generate(fleet.router_address, token_request(system + random_tokens(20, 2, vocab), max_tokens=MAX_TOKENS))
    assert first.last.usage.cached_tokens == 0
    for seed in (3, 4):
        prompt = system + random_tokens(30, seed, vocab)
        request = token_request(prompt, max_tokens=MAX_TOKENS)
        request.request_id = f"shared-prefix-{seed}"
        answer = generate(fleet.router_address, request)
        assert answer.last.usage.cached_tokens == 5 * BLOCK  # the system prompt's full blocks
        assert_exact(answer, prompt, reference_model)
        # the router's prefix index expected the hit it routed for (services.router.picker)
        assert routed_expecting(fleet, request.request_id) == 5 * BLOCK


def test_a_router_expects_what_another_router_sent_from_the_workers_published_events(fleet, reference_model):
    """The cluster-wide prefix index: the second router never routed this system prompt, but the prefill
    and decode workers published that they hold its blocks (distserve.prefix_events), so it expects them."""
    vocab = reference_model.config.vocab_size
    system = random_tokens(4 * BLOCK + 5, seed=300, vocab=vocab)
    first_router, second_router = fleet.router_addresses
    generate(first_router, token_request(system + random_tokens(7, seed=301, vocab=vocab), max_tokens=4))
    wait_for_published(fleet, {("prefill", PREFILL_CACHE), ("decode", PAGED_CACHE)})
    prompt = system + random_tokens(9, seed=302, vocab=vocab)
    request = token_request(prompt, max_tokens=MAX_TOKENS)
    request.request_id = "prefix-from-events"
    answer = generate(second_router, request)
    assert answer.last.usage.cached_tokens == 4 * BLOCK
    assert_exact(answer, prompt, reference_model)
    assert routed_expecting(fleet, request.request_id, router="router-1") == 4 * BLOCK
    assert routed_expecting(fleet, request.request_id, "decode_expected_cached", router="router-1") == 4 * BLOCK


def wait_for_published(fleet, sources: set[tuple[str, str]], timeout_s: float = 15) -> None:
    """Until a worker of each (role, cache) in `sources` has published stored blocks, and a moment more for the
    routers, whose blocking read returns as soon as an event is added, to fold them in."""
    client = redis.Redis.from_url(fleet.redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            events = [parse_entry(fields) for _, fields in client.xrange(STREAM_KEY)]
            published = {(e.worker_id.split("-")[0], e.cache) for e in events if e is not None and e.op == STORED}
            if sources <= published:
                break
            assert time.monotonic() < deadline, f"only {published} published"
            time.sleep(0.05)
    finally:
        client.close()
    time.sleep(0.5)


def test_the_prefill_worker_counts_hits_and_queries(fleet, reference_model):
    vocab = reference_model.config.vocab_size
    prompt = random_tokens(2 * BLOCK + 4, seed=60, vocab=vocab)
    before = scrape(fleet, "prefill-0")
    for _ in range(2):
        generate(fleet.router_address, token_request(prompt, max_tokens=2))
    after = scrape(fleet, "prefill-0")
    queries, hits = "distserve:prefix_cache_queries_total{}", "distserve:prefix_cache_hits_total{}"
    assert after[queries] - before[queries] == 2 * len(prompt)
    assert after[hits] - before[hits] == 2 * BLOCK
    assert after["distserve:prefix_cache_blocks{}"] >= 2


def test_a_follow_up_turn_reuses_the_last_turns_prompt_blocks(fleet, reference_model):
    vocab = reference_model.config.vocab_size
    turn1 = random_tokens(70, seed=10, vocab=vocab)
    answer1 = generate(fleet.router_address, token_request(turn1, max_tokens=MAX_TOKENS))
    turn2 = turn1 + answer1.token_ids + random_tokens(25, seed=11, vocab=vocab)
    answer2 = generate(fleet.router_address, token_request(turn2, max_tokens=MAX_TOKENS))
    assert answer2.last.usage.cached_tokens == (len(turn1) // BLOCK) * BLOCK
    assert_exact(answer1, turn1, reference_model)
    assert_exact(answer2, turn2, reference_model)


def test_a_decode_worker_holding_a_prefix_pulls_only_the_rest(fleet, reference_model):
    """While one sequence holding a system prompt's blocks decodes, a second prompt that starts with it
    shares those blocks on the decode worker and pulls only the KV from the last checksum chunk boundary
    (CHUNK_TOKENS) before their end; its output stays token-exact."""
    import concurrent.futures

    from distserve.transfer.checksum import CHUNK_TOKENS
    from tests.cluster_helpers import worker_stats

    vocab = reference_model.config.vocab_size
    system = random_tokens(9 * BLOCK, seed=90, vocab=vocab)  # 144 tokens: 2 whole chunks of 64 shared
    holder_prompt = system + random_tokens(7, seed=91, vocab=vocab)
    before = worker_stats(fleet, "decode-0")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        holder = pool.submit(generate, fleet.router_address,
                             token_request(holder_prompt, max_tokens=1500, ignore_eos=True))
        deadline = time.monotonic() + 60
        while (mid := worker_stats(fleet, "decode-0")).kv_transfers_received == before.kv_transfers_received:
            assert time.monotonic() < deadline and not holder.done(), "the holder's KV never reached decode"
            time.sleep(0.05)
        prompt = system + random_tokens(40, seed=92, vocab=vocab)
        answer = generate(fleet.router_address, token_request(prompt, max_tokens=MAX_TOKENS))
        after = worker_stats(fleet, "decode-0")
        assert len(holder.result().token_ids) == 1500
    per_token = (mid.kv_bytes_received - before.kv_bytes_received) // len(holder_prompt)
    pulled_from = len(system) // CHUNK_TOKENS * CHUNK_TOKENS
    assert after.kv_bytes_received - mid.kv_bytes_received == (len(prompt) - pulled_from) * per_token, \
        "the whole prompt's KV was pulled (did the holder finish before the second prompt arrived?)"
    assert_exact(answer, prompt, reference_model)


def test_a_follow_up_turn_pulls_only_what_the_decode_worker_lacks(fleet, reference_model):
    """The decode worker keeps a finished answer's full blocks cached: turn 2 (turn 1's prompt, its
    answer and a new message) shares them there and pulls only from the last checksum chunk boundary
    before their end; its output stays token-exact."""

    from distserve.transfer.checksum import CHUNK_TOKENS
    from tests.cluster_helpers import worker_stats

    config = reference_model.config
    vocab = config.vocab_size
    bytes_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4  # fp32 KV
    turn1 = random_tokens(9 * BLOCK + 5, seed=95, vocab=vocab)
    answer1 = generate(fleet.router_address, token_request(turn1, max_tokens=40, ignore_eos=True))
    before = worker_stats(fleet, "decode-0")
    turn2 = turn1 + answer1.token_ids + random_tokens(30, seed=96, vocab=vocab)
    answer2 = generate(fleet.router_address, token_request(turn2, max_tokens=MAX_TOKENS))
    after = worker_stats(fleet, "decode-0")
    held = (len(turn1) + len(answer1.token_ids) - 1) // BLOCK * BLOCK  # the last answer token has no KV yet
    pulled_from = held // CHUNK_TOKENS * CHUNK_TOKENS
    assert pulled_from > 0
    assert after.kv_bytes_received - before.kv_bytes_received == (len(turn2) - pulled_from) * bytes_per_token
    assert answer2.last.usage.cached_tokens == len(turn1) // BLOCK * BLOCK  # the prefill worker's own hit
    assert_exact(answer2, turn2, reference_model)
    deadline = time.monotonic() + 15  # the gauge is set with each registry heartbeat
    while scrape(fleet, "decode-0")["distserve:kv_cache_cached_blocks{}"] < held // BLOCK:
        assert time.monotonic() < deadline, "the decode worker reports fewer cached blocks than it shared"
        time.sleep(0.2)


def test_a_follow_up_turn_goes_back_to_the_decode_worker_holding_the_last_one(cluster, reference_model):
    """With two decode workers, each conversation's second turn is routed to the decode worker that
    produced its first answer: the router expects that turn's first blocks there."""
    vocab = reference_model.config.vocab_size
    for seed in (200, 210, 220):
        turn1 = random_tokens(6 * BLOCK + 3, seed=seed, vocab=vocab)
        first = generate(cluster.router_address, token_request(turn1, max_tokens=20, ignore_eos=True))
        holder = first.messages[0].decode_worker
        turn2 = turn1 + first.token_ids + random_tokens(10, seed=seed + 1, vocab=vocab)
        request = token_request(turn2, max_tokens=4)
        request.request_id = f"decode-affinity-{seed}"
        second = generate(cluster.router_address, request)
        assert second.messages[0].decode_worker == holder
        held = (len(turn1) + len(first.token_ids) - 1) // BLOCK * BLOCK
        assert routed_expecting(cluster, request.request_id, "decode_expected_cached") == held


def test_structured_output_over_a_cached_prefix_equals_its_uncached_run(fleet, reference_model):
    """A grammar-constrained greedy request whose prompt is cached gives what it gave computing it all."""
    import re

    from distserve.v1 import common_pb2
    prompt = random_tokens(4 * BLOCK + 5, seed=80, vocab=reference_model.config.vocab_size)

    def run():
        request = token_request(prompt, max_tokens=24)
        request.sampling.structured_output.CopyFrom(common_pb2.StructuredOutput(regex="[a-z]{3,6}-[0-9]{2}"))
        return generate(fleet.router_address, request)

    uncached, cached = run(), run()
    assert (uncached.last.usage.cached_tokens, cached.last.usage.cached_tokens) == (0, 4 * BLOCK)
    assert cached.token_ids == uncached.token_ids and re.fullmatch("[a-z]{3,6}-[0-9]{2}", cached.text)


def test_n_completions_share_a_cached_prefix(fleet, reference_model):
    vocab = reference_model.config.vocab_size
    prefix = random_tokens(3 * BLOCK, seed=20, vocab=vocab)
    generate(fleet.router_address, token_request(prefix + [5, 6, 7], max_tokens=2))
    prompt = prefix + random_tokens(9, seed=21, vocab=vocab)
    request = token_request(prompt, max_tokens=MAX_TOKENS)
    request.n = 2
    answer = generate(fleet.router_address, request)
    last = [m for m in answer.messages if m.HasField("usage")]
    assert {m.usage.cached_tokens for m in last} == {3 * BLOCK}
    reference = reference_generate(reference_model, prompt, MAX_TOKENS)
    for index in (0, 1):
        tokens = [t for m in answer.messages if m.index == index for t in m.token_ids]
        assert compare_with_tolerance(tokens, reference)[0]


def test_cache_salt_separates_tenants_and_equal_salts_share(fleet, reference_model):
    vocab = reference_model.config.vocab_size
    prompt = random_tokens(4 * BLOCK + 5, seed=30, vocab=vocab)

    def cached(salt: str) -> int:
        request = token_request(prompt, max_tokens=4)
        request.sampling.cache_salt = salt
        return generate(fleet.router_address, request).last.usage.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same tokens, another salt: no hit
    assert cached("") == 0  # nor without one
    assert cached("tenant-a") == 4 * BLOCK  # the same salt shares


def test_prompt_logprobs_are_computed_not_cached(fleet, reference_model):
    vocab = reference_model.config.vocab_size
    prompt = random_tokens(3 * BLOCK + 2, seed=40, vocab=vocab)
    generate(fleet.router_address, token_request(prompt, max_tokens=2))
    request = token_request(prompt, max_tokens=2)
    request.sampling.prompt_logprobs = 1
    answer = generate(fleet.router_address, request)
    assert answer.last.usage.cached_tokens == 0
    assert len(answer.messages[0].prompt_logprobs) == len(prompt) - 1
    again = generate(fleet.router_address, token_request(prompt, max_tokens=2))
    assert again.last.usage.cached_tokens == 3 * BLOCK  # the cache is still there for the others


def test_the_openai_usage_reports_cached_tokens(fleet, reference_model, tiny_model_path):
    vocab = reference_model.config.vocab_size
    model = Path(tiny_model_path).name  # the gateway serves the folder's name
    prompt = random_tokens(2 * BLOCK + 1, seed=50, vocab=vocab)

    def completion() -> dict:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0}).encode()
        request = urllib.request.Request(fleet.gateway_url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            return json.loads(reply.read())

    assert completion()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    usage = completion()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2 * BLOCK} and usage["prompt_tokens"] == len(prompt)


def test_the_multi_turn_bench_sends_each_answer_back_and_the_cache_serves_it(fleet, tiny_model_path, tmp_path):
    """`distserve bench --workload multi-turn`: turn k + 1's prompt holds turn k's answer as token ids
    (return_token_ids), so the prefill worker finds every earlier turn's prompt blocks cached."""
    before = scrape(fleet, "prefill-0")["distserve:prefix_cache_hits_total{}"]
    out = tmp_path / "chat"
    done = subprocess.run(
        [sys.executable, "-m", "distserve.bench", "--url", fleet.gateway_url, "--model", Path(tiny_model_path).name,
         "--tokenizer", tiny_model_path, "--workload", "multi-turn", "--rates", "inf", "--conversations", "2",
         "--turns", "3", "--system-len", "40", "--user-len", "10", "--answer-len", "5", "--think-s", "0",
         "--out", str(out)], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    requests = json.loads((out / "results.json").read_text())["rates"][0]["requests"]
    assert len(requests) == 6 and all(r["ok"] for r in requests)
    assert sorted(r["input_len"] for r in requests) == [50, 50, 65, 65, 80, 80]  # + answer 5 + user 10 a turn
    hits = scrape(fleet, "prefill-0")["distserve:prefix_cache_hits_total{}"] - before
    # each conversation's turns 2 and 3 find the full blocks of the turn before (50 -> 48, 65 -> 64 tokens);
    # turn 1 of one may find the 40-token system prompt's 2 blocks, unless both first turns share a forward
    assert 2 * (48 + 64) <= hits <= 2 * (48 + 64) + 2 * BLOCK
