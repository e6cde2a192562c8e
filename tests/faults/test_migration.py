"""Request migration: a worker killed (-9) with requests in flight costs the client nothing.

The router re-prefills the prompt plus the completion so far on a live prefill worker and
continues on a live decode worker; the client's stream carries every token once, and greedy
and seeded-sampling output equal an unfailed run's. The fixture then checks that the
supervisor restarted the worker and that no KV handle, held KV or block leaked.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import grpc
import openai
import pytest
import redis

from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.kvbroker.store import HANDLE_KEY_PREFIX
from services.router.config import RouterConfig
from tests.cluster_helpers import WORKER_LEASE_S, worker_stats
from tests.faults.conftest import TRANSFER_TIMEOUT_S
from tests.integration.test_metrics import scrape

# Long enough that every stream is still decoding when the worker dies (the tiny model decodes
# a few hundred tokens per second on these machines); the context is 2048.
LONG = 1200

REQUESTS = [  # (prompt, sampling): greedy and seeded sampling, with and without penalties
    ("The quick brown fox", common_pb2.SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)),
    ("Once upon a time", common_pb2.SamplingParams(max_tokens=LONG, temperature=0.8, seed=7, ignore_eos=True)),
    ("In a distant galaxy", common_pb2.SamplingParams(max_tokens=LONG, temperature=1.0, top_p=0.9, seed=11,
                                                      repetition_penalty=1.2, frequency_penalty=0.5,
                                                      ignore_eos=True)),
    ("Serving systems", common_pb2.SamplingParams(max_tokens=LONG, temperature=0, presence_penalty=0.7,
                                                  ignore_eos=True)),
]


class _Stream:
    """One Generate call read on its own thread: the tokens, the text, and who served it."""

    def __init__(self, channel: grpc.Channel, prompt: str, sampling: common_pb2.SamplingParams):
        self.token_ids: list[int] = []
        self.text = ""
        self.messages = 0
        self.decode_worker = self.prefill_worker = ""
        self.decode_workers: list[str] = []  # every decode worker that streamed to it, in order
        self.finish_reason = None
        self.error: grpc.RpcError | None = None
        self.first_token = threading.Event()
        self.decoding = threading.Event()  # a message after the first: the decode worker streams
        request = router_pb2.GenerateRequest(text=prompt, sampling=sampling)
        self._call = router_pb2_grpc.RouterServiceStub(channel).Generate(request, timeout=120)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                if not self.messages:
                    self.prefill_worker, self.decode_worker = message.prefill_worker, message.decode_worker
                    self.first_token.set()
                else:
                    self.decoding.set()
                if message.decode_worker and message.decode_worker not in self.decode_workers:
                    self.decode_workers.append(message.decode_worker)
                self.messages += 1
                self.token_ids.extend(message.token_ids)
                self.text += message.text
                if message.finish_reason:
                    self.finish_reason = message.finish_reason
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.first_token.set()
            self.decoding.set()

    def result(self, timeout_s: float = 120) -> list[int]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "stream did not end"
        assert self.error is None, f"stream failed: {self.error.code()} {self.error.details()}"
        assert self.finish_reason == common_pb2.FINISH_REASON_LENGTH
        return self.token_ids


def _run_all(cluster, requests=REQUESTS) -> list[_Stream]:
    channel = grpc.insecure_channel(cluster.router_address)
    return [_Stream(channel, prompt, sampling) for prompt, sampling in requests]


def _process_name(cluster, worker_id: str) -> str:
    """The launcher's name (e.g. decode-1) of the worker registered as worker_id (role-host-port)."""
    port = worker_id.rsplit("-", 1)[-1]
    names = [name for name, process in cluster.processes.items()
             if process.address and process.address.endswith(f":{port}")]
    assert len(names) == 1, f"no single process serves {worker_id}: {names}"
    return names[0]


def _wait_handed_over(cluster, timeout_s: float = 30) -> None:
    """Until the prefill worker has handed its KV handle to the router: the handle is registered with
    the kvbroker (a key in Redis), and the worker sends it right after (the first token comes before
    either); the margin covers that send on a loaded machine, as nothing in the router shows it."""
    store = redis.Redis.from_url(cluster.redis_url)
    deadline = time.monotonic() + timeout_s
    while not store.keys(HANDLE_KEY_PREFIX + "*"):
        assert time.monotonic() < deadline, "no KV handle registered"
        time.sleep(0.02)
    time.sleep(0.5)


def _router_retries(cluster, stage: str) -> float:
    """The router's distserve:request_retries_total for `stage`, from its /metrics endpoint."""
    text = urllib.request.urlopen(cluster.processes["router"].metrics_url, timeout=10).read().decode()
    prefix = f'distserve:request_retries_total{{stage="{stage}"}} '
    return sum(float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix))


@pytest.fixture(scope="module")
def unfailed(faults_cluster) -> list[list[int]]:
    """Each request's tokens from a run where nothing failed."""
    return [stream.result() for stream in _run_all(faults_cluster)]


def test_the_first_token_reaches_the_client_before_its_kv_is_registered(faults_cluster, unfailed):
    """The prefill worker streams the first token, then registers the KV with the kvbroker: with the
    kvbroker paused the client still gets its first token (and no decode can start); once the
    kvbroker resumes, the request ends as an unfailed run does."""
    broker = faults_cluster.processes["kvbroker"].popen.pid
    os.kill(broker, signal.SIGSTOP)
    try:
        stream = _run_all(faults_cluster, REQUESTS[:1])[0]
        assert stream.first_token.wait(30), "no first token while the kvbroker is paused"
        assert stream.error is None and stream.messages == 1 and not stream.decoding.is_set()
    finally:
        os.kill(broker, signal.SIGCONT)
    assert stream.result() == unfailed[0]


def test_decode_worker_killed_mid_stream_continues_elsewhere_with_identical_output(faults_cluster, unfailed):
    retries_before = _router_retries(faults_cluster, "decode")
    streams = _run_all(faults_cluster)
    for stream in streams:
        assert stream.decoding.wait(60), "no stream reached decode"
    victim = streams[0].decode_worker
    faults_cluster.kill(_process_name(faults_cluster, victim))
    on_victim = [s for s in streams if s.decode_worker == victim]

    assert [s.result() for s in streams] == unfailed
    assert all(s.messages > 2 for s in on_victim)  # the victim streamed some, another worker the rest
    assert _router_retries(faults_cluster, "decode") >= retries_before + len(on_victim)


def _prefix_hits(cluster) -> float:
    """Prompt tokens the prefill workers have taken from their prefix caches so far."""
    return sum(scrape(cluster, name).get("distserve:prefix_cache_hits_total{}", 0.0)
               for name in cluster.processes if name.startswith("prefill"))


def test_a_migrated_request_reuses_its_cached_prompt_and_its_output_is_unchanged(faults_cluster):
    """A decode worker dies mid-stream: the router prefills the prompt plus the completion so far again,
    and that prefill reuses the prompt's blocks an earlier prefill cached (the router sends it where
    they are). The output equals an unfailed run's."""
    request = [(" ".join(["A serving system streams tokens to its clients."] * 8),
                common_pb2.SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True))]
    unfailed_run = _run_all(faults_cluster, request)[0].result()  # its prefill stores the prompt's blocks
    before = _prefix_hits(faults_cluster)
    assert _run_all(faults_cluster, request)[0].result() == unfailed_run
    one_prefill = _prefix_hits(faults_cluster) - before
    assert one_prefill > 0  # the prompt's full blocks, reused
    stream = _run_all(faults_cluster, request)[0]
    assert stream.decoding.wait(60), "the stream never reached decode"
    before = _prefix_hits(faults_cluster)  # its own first prefill is done (decoding started)
    faults_cluster.kill(_process_name(faults_cluster, stream.decode_worker))
    assert stream.result() == unfailed_run
    assert _prefix_hits(faults_cluster) - before >= one_prefill  # the migration's prefill reused the prompt


def test_prefill_worker_killed_before_its_kv_is_pulled_is_prefilled_again(faults_cluster, unfailed):
    """Decode workers are paused while the prompt is prefilled, so the prefill worker dies holding KV
    that no decode worker has pulled yet; the pull fails and the router prefills again elsewhere."""
    decode_pids = [faults_cluster.processes[name].popen.pid for name in faults_cluster.processes
                   if name.startswith("decode")]
    retries_before = _router_retries(faults_cluster, "decode")
    for pid in decode_pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        stream = _run_all(faults_cluster, REQUESTS[1:2])[0]
        assert stream.first_token.wait(30), "no first token"
        _wait_handed_over(faults_cluster)
        faults_cluster.kill(_process_name(faults_cluster, stream.prefill_worker))
        time.sleep(0.2)
    finally:
        for pid in decode_pids:
            os.kill(pid, signal.SIGCONT)

    assert stream.result() == unfailed[1]
    assert _router_retries(faults_cluster, "decode") >= retries_before + 1


def test_prompts_on_a_paused_prefill_worker_move_to_the_other_once_its_lease_lapses(faults_cluster, unfailed):
    """One prefill worker is paused (SIGSTOP: hung, not dead, so its connection stays up); prompts routed
    to it before its registry lease lapsed move to the other within seconds of the lapse, not after the
    prefill timeout (120 s), and every answer is unchanged."""
    time.sleep(RouterConfig().suspect_s)  # earlier kills leave a worker skipped this long: let both take prompts
    paused = faults_cluster.processes[next(n for n in faults_cluster.processes if n.startswith("prefill"))].popen.pid
    retries_before = _router_retries(faults_cluster, "prefill")
    os.kill(paused, signal.SIGSTOP)
    try:
        started = time.monotonic()
        streams = _run_all(faults_cluster)
        for stream in streams:
            assert stream.first_token.wait(WORKER_LEASE_S + 10), "a prompt waited behind the paused worker"
        elapsed = time.monotonic() - started
    finally:
        os.kill(paused, signal.SIGCONT)
    assert [s.result() for s in streams] == unfailed
    assert _router_retries(faults_cluster, "prefill") >= retries_before + 1, "no prompt went to the paused worker"
    assert elapsed < WORKER_LEASE_S + 10


def test_prefill_worker_killed_while_prefilling_is_retried_on_the_other(faults_cluster, unfailed):
    """Prefill workers are paused so the prompts wait there; one is killed, the other resumed."""
    time.sleep(RouterConfig().suspect_s)  # earlier kills leave a worker skipped this long: let both take prompts
    prefill_names = [name for name in faults_cluster.processes if name.startswith("prefill")]
    pids = {name: faults_cluster.processes[name].popen.pid for name in prefill_names}
    retries_before = _router_retries(faults_cluster, "prefill")
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        streams = _run_all(faults_cluster)
        time.sleep(0.5)  # the router has sent every prompt to a (paused) prefill worker
        faults_cluster.kill(prefill_names[0])
    finally:
        os.kill(pids[prefill_names[1]], signal.SIGCONT)

    assert [s.result() for s in streams] == unfailed
    assert _router_retries(faults_cluster, "prefill") >= retries_before + 1


def test_a_stalled_prefill_worker_holding_kv_costs_one_transfer_timeout(faults_cluster, unfailed):
    """Like the killed-holding-KV test, but the prefill worker is paused (SIGSTOP), not killed: the
    pull times out, the router prefills again on the other worker and skips the stalled one for a
    while (last in this module, so that skip cannot steer the other tests' routing)."""
    decode_pids = [faults_cluster.processes[name].popen.pid for name in faults_cluster.processes
                   if name.startswith("decode")]
    for pid in decode_pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        stream = _run_all(faults_cluster, REQUESTS[1:2])[0]
        assert stream.first_token.wait(30), "no first token"
        _wait_handed_over(faults_cluster)
        stalled = faults_cluster.processes[_process_name(faults_cluster, stream.prefill_worker)].popen.pid
        os.kill(stalled, signal.SIGSTOP)
    finally:
        for pid in decode_pids:
            os.kill(pid, signal.SIGCONT)
    started = time.monotonic()
    try:
        tokens = stream.result()
        elapsed = time.monotonic() - started
    finally:
        os.kill(stalled, signal.SIGCONT)

    assert tokens == unfailed[1]
    assert elapsed < TRANSFER_TIMEOUT_S + 10, f"took {elapsed:.1f}s"


def test_a_forced_tool_call_streamed_through_the_gateway_survives_its_decode_worker(faults_cluster):
    """Tool calls are parsed in the gateway from the router's text: a decode worker killed mid-call costs
    the client nothing, and the streamed call equals an unfailed run's."""
    sdk = openai.OpenAI(base_url=faults_cluster.gateway_url + "/v1", api_key="any-key", max_retries=0)
    note = {"type": "string", "minLength": 700, "maxLength": 700}  # long enough to be decoding when killed
    tools = [{"type": "function", "function": {"name": "write_note", "parameters": {
        "type": "object", "properties": {"note": note}, "required": ["note"], "additionalProperties": False}}}]
    args = dict(model="distserve-tiny", messages=[{"role": "user", "content": "Take a note."}], tools=tools,
                tool_choice={"type": "function", "function": {"name": "write_note"}}, temperature=0, max_tokens=1700)
    unfailed_call = sdk.chat.completions.create(**args).choices[0].message.tool_calls[0].function
    pieces, finish, killed = [], None, False
    for chunk in sdk.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            pieces += [call.function.arguments or "" for call in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
        if len(pieces) == 20 and not killed:  # decoding by now: the first piece came from prefill
            victim = next(name for name in faults_cluster.processes if name.startswith("decode")
                          and worker_stats(faults_cluster, name).num_running)
            faults_cluster.kill(victim)
            killed = True
    assert killed and finish == "tool_calls"
    assert "".join(pieces) == unfailed_call.arguments and len(json.loads(unfailed_call.arguments)["note"]) == 700
