"""Bad requests get INVALID_ARGUMENT naming the field; nothing else breaks."""

from __future__ import annotations

import grpc
import pytest

from distserve.v1 import router_pb2
from tests.builders import generate, sampling, token_request

CONTEXT = 2048  # the tiny model's context
VOCAB = 4096

BAD_REQUESTS = {
    "empty text prompt": (router_pb2.GenerateRequest(text="", sampling=sampling()), "prompt"),
    "empty token prompt": (token_request([]), "prompt"),
    "no prompt": (router_pb2.GenerateRequest(sampling=sampling()), "prompt"),
    "prompt longer than context": (token_request([5] * (CONTEXT + 1)), "prompt"),
    "max_tokens zero": (token_request([5, 6], max_tokens=0), "max_tokens"),
    "max_tokens negative": (token_request([5, 6], max_tokens=-3), "max_tokens"),
    "temperature negative": (token_request([5, 6], temperature=-0.5), "temperature"),
    "top_p zero": (token_request([5, 6], top_p=0.0), "top_p"),
    "top_p above one": (token_request([5, 6], top_p=1.5), "top_p"),
    "token id beyond vocab": (token_request([5, VOCAB]), "prompt"),
    "negative token id": (token_request([-1, 5]), "prompt"),
    "logit_bias id beyond vocab": (token_request([5, 6], logit_bias={VOCAB: 1.0}), "logit_bias"),
    "logit_bias value above 100": (token_request([5, 6], logit_bias={7: 101.0}), "logit_bias"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_invalid_argument_naming_field(cluster, case):
    request, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        generate(cluster.router_address, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field + ":"), info.value.details()


def test_good_request_still_served_after_bad_ones(cluster):
    for request, _ in BAD_REQUESTS.values():
        with pytest.raises(grpc.RpcError):
            generate(cluster.router_address, request)
    answer = generate(cluster.router_address, token_request([5, 6, 7], max_tokens=5))
    assert len(answer.token_ids) == 5
    assert answer.last.finish_reason == 2  # LENGTH


def test_stop_token_and_max_tokens_one(cluster):
    one = generate(cluster.router_address, token_request([9, 10, 11], max_tokens=1))
    assert len(one.token_ids) == 1 and one.last.finish_reason == 2
    full = generate(cluster.router_address, token_request([9, 10, 11], max_tokens=8, ignore_eos=True))
    stop_at = full.token_ids[3]
    stopped = generate(cluster.router_address,
                       token_request([9, 10, 11], max_tokens=8, stop_token_ids=[stop_at], ignore_eos=True))
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(stop_at) + 1]
    assert stopped.last.finish_reason == 1  # STOP


def test_logit_bias_steers_prefill_and_decode(cluster):
    # The first token is sampled by a prefill worker, the rest by a decode worker: both apply the bias.
    prompt = [9, 10, 11]
    full = generate(cluster.router_address, token_request(prompt, max_tokens=6, ignore_eos=True))
    target = next(t for t in range(100, VOCAB) if t not in full.token_ids)
    forced = generate(cluster.router_address,
                      token_request(prompt, max_tokens=6, ignore_eos=True, logit_bias={target: 100.0}))
    assert forced.token_ids == [target] * 6
    sampled = generate(cluster.router_address, token_request(prompt, max_tokens=6, ignore_eos=True, temperature=1.0,
                                                             seed=3, logit_bias={target: 100.0}))
    assert sampled.token_ids == [target] * 6
    banned = generate(cluster.router_address,
                      token_request(prompt, max_tokens=6, ignore_eos=True, logit_bias={full.token_ids[0]: -100.0}))
    assert banned.token_ids[0] != full.token_ids[0] and full.token_ids[0] not in banned.token_ids


def test_stop_string_ends_the_answer_and_usage_counts_only_tokens_up_to_it(cluster, tiny_model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompt = [40, 41, 42, 43]
    full = generate(cluster.router_address, token_request(prompt, max_tokens=24, ignore_eos=True))
    text = tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = generate(cluster.router_address, token_request(prompt, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert cut.text == text[: text.index(stop)]
    assert cut.last.finish_reason == 1  # STOP
    assert cut.last.usage.completion_tokens == len(cut.token_ids) <= len(full.token_ids)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert stop in tokenizer.decode(cut.token_ids, skip_special_tokens=True)  # the last token completed it
    assert stop not in tokenizer.decode(cut.token_ids[:-1], skip_special_tokens=True)


def test_tiny_temperature_is_served_as_greedy(cluster):
    greedy = generate(cluster.router_address, token_request([50, 51, 52], max_tokens=6))
    tiny = generate(cluster.router_address, token_request([50, 51, 52], max_tokens=6, temperature=1e-39))
    assert tiny.token_ids == greedy.token_ids


def test_cancelling_during_prefill_frees_the_kv_at_once(cluster):
    """The autouse check after this test requires no handle and no held KV within 5 s (the lease is 30 s)."""
    import time

    from distserve.v1 import router_pb2_grpc

    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for delay_s in (0.0, 0.05, 0.1, 0.2):
            call = stub.Generate(token_request(list(range(3, 1500)), max_tokens=4), timeout=60)
            time.sleep(delay_s)
            call.cancel()
