"""KV bytes move prefill -> decode over UCX; the broker only ever sees metadata (the KV's checksum, never
its pull secret); a decode worker presenting the wrong secret is refused."""

from __future__ import annotations

import grpc
import pytest
import redis

from distserve.v1 import kvbroker_pb2, kvbroker_pb2_grpc
from tests.builders import generate, token_request
from tests.cluster_helpers import decode_with_secret, prefill_with_secret, rewrite_handle
from tests.integration.conftest import worker_stats

PROMPT_LEN = 600


def name_of(cluster, worker_id: str) -> str:
    port = worker_id.rpartition("-")[2]
    return next(n for n, p in cluster.processes.items() if p.address.endswith(":" + port))


def broker_stats(cluster) -> kvbroker_pb2.GetBrokerStatsResponse:
    with grpc.insecure_channel(cluster.broker_address) as channel:
        return kvbroker_pb2_grpc.KvBrokerServiceStub(channel).GetBrokerStats(
            kvbroker_pb2.GetBrokerStatsRequest(), timeout=10)


def settled_stats(cluster, names: list[str], timeout_s: float = 10.0) -> dict:
    """Worker stats once every byte received has been counted as sent too: the sender counts on the
    receiver's acknowledgement, which may trail the end of an earlier test's request."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        stats = {n: worker_stats(cluster, n) for n in names}
        sent = sum(s.kv_bytes_sent for n, s in stats.items() if n.startswith("prefill"))
        received = sum(s.kv_bytes_received for n, s in stats.items() if n.startswith("decode"))
        if sent == received or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_kv_bytes_travel_over_ucx_between_workers(cluster, tiny_model_path):
    from distserve.model_spec import load_model_spec

    spec = load_model_spec(tiny_model_path)
    names = [n for n in cluster.processes if n.startswith(("prefill", "decode"))]
    before = settled_stats(cluster, names)
    # A prompt no other test sends: a decode worker holding some of its blocks (cached from an earlier
    # request) would pull only the rest, and the byte counts below are a whole pull's.
    prompt = [(i * 53 + 17) % 4000 + 3 for i in range(PROMPT_LEN)]
    answer = generate(cluster.router_address, token_request(prompt, max_tokens=4))
    first = answer.messages[0]
    prefill, decode = name_of(cluster, first.prefill_worker), name_of(cluster, first.decode_worker)
    after = settled_stats(cluster, names)

    handle_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * PROMPT_LEN * 4  # fp32
    assert after[prefill].kv_bytes_sent - before[prefill].kv_bytes_sent == handle_bytes
    assert after[prefill].kv_transfers_sent - before[prefill].kv_transfers_sent == 1
    assert after[decode].kv_bytes_received - before[decode].kv_bytes_received == handle_bytes
    assert after[decode].kv_transfers_received - before[decode].kv_transfers_received == 1
    assert answer.last.timings.transfer_s > 0

    stats = broker_stats(cluster)
    assert not stats.ucx_loaded, "the broker process must never load UCX"
    assert stats.num_registered >= 1 and stats.num_claimed >= 1 and stats.num_released >= 1
    assert stats.max_request_bytes < 1024 < handle_bytes, "broker requests carry metadata only"


def test_decode_pulls_with_the_request_secret_and_a_wrong_one_is_refused(cluster):
    prompt = list(range(20, 80))
    right = prefill_with_secret(cluster, "prefill-0", prompt, "minted-for-this-request")
    tokens = decode_with_secret(cluster, "decode-0", prompt, right, "minted-for-this-request")
    assert len(tokens) == 3, "the decode worker presented the secret and pulled the KV"
    handle = kvbroker_pb2.KvHandle()  # the broker saw the checksum but never the secret
    wrong = prefill_with_secret(cluster, "prefill-0", prompt, "minted-for-another-request")
    record = redis.Redis.from_url(cluster.redis_url).hget(f"distserve:kv:{wrong.kv_handle_id}", "handle")
    handle.ParseFromString(record)
    assert handle.kv_crc32c != 0 and b"minted-for" not in record
    with pytest.raises(grpc.RpcError) as refused:
        decode_with_secret(cluster, "decode-0", prompt, wrong, "minted-for-this-request")
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS and "refused" in refused.value.details()


@pytest.mark.parametrize("secret", ["", "short-secret"])
def test_a_prefill_without_a_real_kv_secret_is_refused_naming_it(cluster, secret):
    """An empty secret would let any puller presenting "" fetch the KV: the worker refuses the prompt."""
    with pytest.raises(grpc.RpcError) as refused:
        prefill_with_secret(cluster, "prefill-0", list(range(20, 40)), secret)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("kv_secret:")


def test_a_handle_record_without_a_checksum_is_refused_and_nothing_is_loaded(cluster):
    """A handle rewritten in Redis without its checksum (a CRC32C of 0 used to mean "none": unverified), by
    a writer holding the registry key (tests/security: one without it is refused before this check)."""
    prompt = list(range(20, 80))
    reply = prefill_with_secret(cluster, "prefill-0", prompt, "minted-for-this-request")
    rewrite_handle(cluster, reply.kv_handle_id, lambda handle: handle.ClearField("kv_crc32c"), resign=True)
    with pytest.raises(grpc.RpcError) as refused:
        decode_with_secret(cluster, "decode-0", prompt, reply, "minted-for-this-request")
    assert refused.value.code() == grpc.StatusCode.DATA_LOSS and "no checksum" in refused.value.details()
