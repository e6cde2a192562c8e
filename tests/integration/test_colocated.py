"""Colocated mode: 2 workers that each prefill and decode, behind the same router and gateway.

The correctness checks of the disaggregated path run here too: greedy output equals transformers',
and seeded sampling equals the disaggregated cluster's output token for token.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import signal
import time

import grpc
import openai
import pytest

from distserve.engine.model_loader import load_model
from distserve.launcher import Cluster, ClusterSpec
from distserve.v1 import colocated_pb2, colocated_pb2_grpc
from tests.builders import compare_with_tolerance, generate, reference_generate, sampling, token_request
from tests.integration.conftest import leftover_state, wait_for_workers
from tests.integration.test_correctness import MAX_TOKENS, make_prompts


@pytest.fixture(scope="module")
def colocated(tiny_model_path, tmp_path_factory):
    free_ports = {f.name: 0 for f in dataclasses.fields(ClusterSpec) if f.name.endswith("_port")}
    spec = ClusterSpec(model=tiny_model_path, num_prefill=0, num_decode=0, num_colocated=2, **free_ports,
                       log_dir=str(tmp_path_factory.mktemp("colocated-logs")),
                       colocated_args=["--max-batch-tokens", "256", "--kv-cache-mb", "64", "--heartbeat-s", "0.5"],
                       env={"DISTSERVE_DTYPE": "float32"})
    cluster = Cluster(spec).start()
    wait_for_workers(cluster, 0, 0, num_colocated=2)
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def colocated_is_clean_after(colocated):
    yield
    deadline = time.monotonic() + 5
    while any(v for v in leftover_state(colocated).values()):
        assert time.monotonic() < deadline, f"colocated workers not clean: {leftover_state(colocated)}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference_model(tiny_model_path):
    return load_model(tiny_model_path, "float32", "cpu")


def test_concurrent_greedy_matches_transformers(colocated, reference_model):
    prompts = make_prompts(reference_model.config.vocab_size)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(
            lambda p: generate(colocated.router_address, token_request(p, max_tokens=MAX_TOKENS)), prompts))
    mismatches = []
    for prompt, answer in zip(prompts, answers):
        ok, _ = compare_with_tolerance(answer.token_ids, reference_generate(reference_model, prompt, MAX_TOKENS))
        if not ok:
            mismatches.append((len(prompt), answer.token_ids))
        assert answer.last.usage.prompt_tokens == len(prompt)
        assert answer.last.usage.completion_tokens == len(answer.token_ids) == MAX_TOKENS
        assert answer.messages[0].prefill_worker == answer.messages[0].decode_worker  # one worker did both
    assert not mismatches, mismatches
    assert len({a.messages[0].prefill_worker for a in answers}) == 2
    assert all(a.last.timings.first_token_s > 0 and a.last.timings.decode_s > 0 for a in answers)


def test_seeded_sampling_equals_the_disaggregated_path(colocated, cluster):
    prompts = make_prompts(4096)[:4]

    def run(system: Cluster) -> list[list[int]]:
        return [generate(system.router_address, token_request(p, max_tokens=16, temperature=0.9, top_p=0.95,
                                                              top_k=200, seed=1234)).token_ids for p in prompts]

    assert run(colocated) == run(cluster)


def test_logprobs_and_structured_output_equal_the_disaggregated_path(colocated, cluster):
    from distserve.v1 import common_pb2
    request = token_request([9, 10, 11, 12], max_tokens=40, temperature=0.9, seed=77, logprobs=2, prompt_logprobs=1)
    request.sampling.structured_output.CopyFrom(common_pb2.StructuredOutput(regex="[a-z]{3,6}-[0-9]{2}"))

    def run(system: Cluster):
        answer = generate(system.router_address, request)
        return (answer.token_ids, answer.text, [(e.token_id, round(e.logprob, 4)) for m in answer.messages
                                                for e in m.logprobs],
                [e.token_id for e in answer.messages[0].prompt_logprobs])

    colocated_answer = run(colocated)
    assert colocated_answer == run(cluster)
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", colocated_answer[1])
    assert len(colocated_answer[2]) == len(colocated_answer[0]) and colocated_answer[3] == [10, 11, 12]


def test_n_above_one_is_refused_by_colocated_workers_alone(colocated):
    request = token_request([5, 6, 7], max_tokens=4)
    request.n = 2
    with pytest.raises(grpc.RpcError) as info:
        generate(colocated.router_address, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("n:")


def test_gateway_streams_the_router_output(colocated):
    sdk = openai.OpenAI(base_url=colocated.gateway_url + "/v1", api_key="unused", max_retries=0)
    reference = generate(colocated.router_address, token_request([5, 6, 7, 8], max_tokens=12))
    chunks = list(sdk.completions.create(model="distserve-tiny", prompt=[5, 6, 7, 8], max_tokens=12,
                                         temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cancelling_at_any_point_frees_the_blocks(colocated):
    """Cancels during prefill of a long prompt and during decode; the autouse check wants 0 used blocks."""
    from distserve.v1 import router_pb2_grpc

    with grpc.insecure_channel(colocated.router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for delay_s in (0.0, 0.05, 0.2):
            call = stub.Generate(token_request(list(range(3, 1500)), max_tokens=4), timeout=60)
            time.sleep(delay_s)
            call.cancel()
        call = stub.Generate(token_request([5, 6, 7], max_tokens=500), timeout=60)
        assert len(next(call).token_ids) == 1
        next(call)
        call.cancel()
    good = generate(colocated.router_address, token_request([9, 10, 11], max_tokens=5))
    assert len(good.token_ids) == 5


def test_bad_direct_call_is_invalid_argument_naming_the_field(colocated):
    with grpc.insecure_channel(colocated.processes["colocated-0"].address) as channel:
        stub = colocated_pb2_grpc.ColocatedServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.PrefillAndDecode(colocated_pb2.PrefillAndDecodeRequest(request_id="x", sampling=sampling()),
                                       timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in error.value.details()


def test_mixed_fleet_serves_on_both_kinds_of_worker(cluster, reference_model):
    """A colocated worker joins the disaggregated cluster; requests spread over both, output unchanged."""
    cluster.start_service("colocated-extra", "services.colocated", f"127.0.0.1:{_free_port()}",
                          ["--heartbeat-s", "0.5", "--lease-s", "2"])
    try:
        cluster.wait_healthy(cluster.processes["colocated-extra"], 120)
        wait_for_workers(cluster, 2, 2, num_colocated=1)
        prompts = [list(range(10 + i, 300 + i)) for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: generate(cluster.router_address, token_request(p, max_tokens=8)),
                                    prompts))
        workers = {a.messages[0].prefill_worker for a in answers}
        assert any(w.startswith("colocated") for w in workers) and any(w.startswith("prefill") for w in workers)
        for prompt, answer in zip(prompts, answers):
            ok, _ = compare_with_tolerance(answer.token_ids, reference_generate(reference_model, prompt, 8))
            assert ok, (answer.messages[0].prefill_worker, answer.token_ids)
    finally:
        cluster.kill("colocated-extra", signal.SIGTERM)  # deregisters
        cluster.processes["colocated-extra"].popen.wait(30)
        cluster.processes.pop("colocated-extra")


def _free_port() -> int:
    from distserve.launcher import free_port

    return free_port()


def test_gateway_is_ready_with_colocated_workers_alone(colocated):
    import urllib.request

    with urllib.request.urlopen(colocated.gateway_url + "/health", timeout=10) as reply:
        assert reply.status == 200
