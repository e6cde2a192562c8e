"""Replicas, so no single process in the request path fails a request.

Two routers behind the gateway: requests go round them, and a router killed mid-stream costs the client
nothing: the gateway resumes the stream on the other router from the tokens it has (resume_token_ids), and
the output equals an unfailed run's, greedy and seeded.

Two kvbrokers: the router and every worker move a call to the other when one is killed or stalled, so
neither fails a request nor leaks a handle (the faults conftest checks after each test)."""

from __future__ import annotations

import os
import signal

import openai
import pytest

from tests.cluster_helpers import running_cluster, wait_recovered
from tests.faults.conftest import NUM_DECODE, NUM_PREFILL, faults_spec
from tests.faults.test_migration import REQUESTS, _run_all
from tests.integration.test_metrics import scrape

MODEL = "distserve-tiny"
ROUTERS = ("router", "router-1")
LONG = 900  # tokens: still streaming when its router is killed


@pytest.fixture(scope="module")
def replicated(tiny_model_path, tmp_path_factory):
    spec = faults_spec(tiny_model_path, str(tmp_path_factory.mktemp("replica-logs")), num_routers=2,
                       num_kvbrokers=2)
    with running_cluster(spec, NUM_PREFILL, NUM_DECODE) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def sdk(replicated) -> openai.OpenAI:
    return openai.OpenAI(base_url=replicated.gateway_url + "/v1", api_key="any-key", max_retries=0)


def served(cluster) -> dict[str, float]:
    """Requests each router has finished, by name."""
    return {name: sum(v for k, v in scrape(cluster, name).items()
                      if k.startswith("distserve:request_success_total")) for name in ROUTERS}


def test_requests_go_round_both_routers(replicated, sdk):
    before = served(replicated)
    for _ in range(4):
        sdk.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0)
    after = served(replicated)
    assert all(after[name] - before[name] == 2 for name in ROUTERS)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
def test_a_router_killed_mid_stream_is_resumed_on_the_other_with_identical_output(replicated, sdk, sampling):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=LONG,
                extra_body={"ignore_eos": True, "return_token_ids": True}, **sampling)
    unfailed = sdk.completions.create(**args).choices[0]
    text, finish, usage, killed, ids = "", None, None, "", []
    for chunk in sdk.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.choices:
            text += chunk.choices[0].text
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
        if len(text) > 50 and not killed:  # decoding by now
            killed = next(name for name in ROUTERS
                          if scrape(replicated, name).get("distserve:num_requests_running{}", 0) > 0)
            replicated.kill(killed)
    assert killed and finish == "length"
    assert ids == unfailed.model_extra["token_ids"]  # tokens first: a text-only difference is the resume's text
    assert text == unfailed.text
    assert usage.completion_tokens == LONG  # the resumed router counts the tokens it resumed from
    wait_recovered(replicated, NUM_PREFILL, NUM_DECODE)  # the supervisor restarted it


@pytest.fixture(scope="module")
def unfailed(replicated) -> list[list[int]]:
    return [stream.result() for stream in _run_all(replicated, REQUESTS)]


def test_every_service_is_told_both_kvbrokers(replicated):
    assert replicated.broker_addresses == [replicated.processes[n].address for n in ("kvbroker", "kvbroker-1")]
    assert {process.env["DISTSERVE_BROKER_ADDRESS"] for name, process in replicated.processes.items()
            if name.startswith(("router", "prefill", "decode"))} == {",".join(replicated.broker_addresses)}


@pytest.mark.parametrize("broker", ["kvbroker", "kvbroker-1"])
def test_a_stalled_kvbroker_costs_no_request(replicated, unfailed, broker):
    """SIGSTOP: calls to it time out (the clients' rpc deadline) and move to the other, which then serves
    them; with one kvbroker every request would fail. Either replica may be the one a client uses."""
    pid = replicated.processes[broker].popen.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert [stream.result() for stream in _run_all(replicated, REQUESTS)] == unfailed
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_kvbroker_killed_under_load_costs_no_request(replicated, unfailed):
    """Killed while streams run and before more arrive: registers, claims and releases reach the other."""
    for name in ("kvbroker", "kvbroker-1"):
        running = _run_all(replicated, REQUESTS)
        replicated.kill(name)
        arriving = _run_all(replicated, REQUESTS)
        assert [stream.result() for stream in running + arriving] == unfailed + unfailed
        wait_recovered(replicated, NUM_PREFILL, NUM_DECODE)
