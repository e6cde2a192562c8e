"""distserve.client against the real system (the session `cluster`: router, 2 prefill + 2 decode workers).

After each test the autouse fixture checks that no KV handle, held KV or decode block is left.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from distserve.cli import main
from distserve.client import DistServeClient, DistServeError, DistServeSyncClient, FinishReason, Sampling
from tests.cluster_helpers import assert_clean
from tests.integration.test_metrics import scrape, total

PROMPT = "The capital of France is"
# Long enough that a stream still decodes well after it is cancelled (the context is 2048).
ENDLESS = Sampling(max_tokens=1800, temperature=0, ignore_eos=True)


async def test_streamed_greedy_answer_equals_complete(cluster):
    async with DistServeClient(cluster.router_address, timeout_s=120) as client:
        chunks = [c async for c in client.generate(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)]
        completion = await client.complete(PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    assert [t for c in chunks for t in c.token_ids] == completion.token_ids
    assert "".join(c.text for c in chunks) == completion.text
    assert len(completion.token_ids) == 16 and completion.text
    assert chunks[-1].finish_reason is completion.finish_reason is FinishReason.LENGTH
    assert completion.usage.completion_tokens == 16 and completion.timings.first_token_s > 0
    assert chunks[0].prefill_worker.startswith("prefill-") and completion.decode_worker.startswith("decode-")


async def test_token_prompt_and_request_id(cluster):
    async with DistServeClient(cluster.router_address, timeout_s=120) as client:
        completion = await client.complete([5, 6, 7], Sampling(max_tokens=4, temperature=0), request_id="client-1")
    assert completion.request_id == "client-1" and len(completion.token_ids) == 4
    assert completion.usage.prompt_tokens == 3


async def test_n_echo_and_logprobs_come_back_typed(cluster):
    async with DistServeClient(cluster.router_address, timeout_s=120) as client:
        completion = await client.complete([5, 6, 7], n=2, echo=True, max_tokens=4, temperature=0, ignore_eos=True,
                                           logprobs=2)
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(len(c.token_ids) == 4 and c.finish_reason is FinishReason.LENGTH for c in completion.choices)
    assert completion.choices[0].token_ids == completion.choices[1].token_ids  # both greedy
    assert completion.usage.completion_tokens == 8 and completion.prompt_token_ids == [5, 6, 7]
    first = completion.choices[0].logprobs
    assert [e.token_id for e in first] == completion.token_ids
    assert all(e.rank == 1 and len(e.top_token_ids) == 2 for e in first)


def decoded_tokens(cluster) -> float:
    """Tokens the decode workers have generated so far (their Prometheus counter)."""
    return sum(total(scrape(cluster, name), "distserve:generation_tokens_total") for name in ("decode-0", "decode-1"))


async def assert_cancelled(cluster, decoded_before: float) -> None:
    """The request's KV is freed at once, and decoding stopped far short of ENDLESS.max_tokens."""
    await asyncio.to_thread(assert_clean, cluster, 3.0)
    decoded = await asyncio.to_thread(decoded_tokens, cluster)
    assert decoded - decoded_before < ENDLESS.max_tokens / 2
    await asyncio.sleep(0.5)
    assert await asyncio.to_thread(decoded_tokens, cluster) == decoded  # nothing decodes any more


async def test_leaving_the_stream_early_cancels_the_request(cluster):
    before = decoded_tokens(cluster)
    async with DistServeClient(cluster.router_address, timeout_s=120) as client:
        num_chunks = 0
        async for _ in client.generate(PROMPT, ENDLESS):
            num_chunks += 1
            if num_chunks == 3:  # the decode worker streams
                break
        await assert_cancelled(cluster, before)


async def test_aclose_cancels_the_request(cluster):
    before = decoded_tokens(cluster)
    async with DistServeClient(cluster.router_address, timeout_s=120) as client:
        stream = client.generate(PROMPT, ENDLESS)
        await anext(stream)
        await anext(stream)  # a second message: the decode worker streams
        await stream.aclose()
        await assert_cancelled(cluster, before)


async def test_cancelling_the_task_cancels_the_request(cluster):
    before = decoded_tokens(cluster)
    async with DistServeClient(cluster.router_address, timeout_s=120) as client:
        decoding = asyncio.Event()

        async def read() -> None:
            num_chunks = 0
            async for _ in client.generate(PROMPT, ENDLESS):
                num_chunks += 1
                if num_chunks == 3:
                    decoding.set()

        task = asyncio.create_task(read())
        await asyncio.wait_for(decoding.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_cancelled(cluster, before)
        assert len((await client.complete([9, 10], max_tokens=3, temperature=0)).token_ids) == 3


async def test_invalid_argument_names_the_field(cluster):
    async with DistServeClient(cluster.router_address, timeout_s=60) as client:
        with pytest.raises(DistServeError) as error:
            await client.complete(PROMPT, top_p=1.5)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.field == "top_p", error.value.message


async def test_tokenize_detokenize_round_trip(cluster):
    async with DistServeClient(cluster.router_address, timeout_s=60) as client:
        tokens = await client.tokenize(PROMPT, add_special_tokens=False)
        assert tokens.token_ids and tokens.max_model_len == 2048
        assert await client.detokenize(tokens.token_ids) == PROMPT
        completion = await client.complete(tokens.token_ids, max_tokens=8, temperature=0, ignore_eos=True)
        assert await client.detokenize(completion.token_ids) == completion.text


def test_sync_client_matches_the_async_one(cluster):
    with DistServeSyncClient(cluster.router_address, timeout_s=120) as client:
        streamed = [t for c in client.generate(PROMPT, max_tokens=8, temperature=0) for t in c.token_ids]
        completion = client.complete(PROMPT, max_tokens=8, temperature=0)
    assert streamed == completion.token_ids and completion.finish_reason is not None


def test_distserve_generate_prints_the_answer(cluster, capsys):
    with DistServeSyncClient(cluster.router_address, timeout_s=120) as client:
        expected = client.complete(PROMPT, max_tokens=8, temperature=0).text
    assert main(["generate", PROMPT, "--router", cluster.router_address, "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out == expected + "\n"
    assert err.startswith("[FINISH_REASON_") and "end to end" in err
    assert main(["generate", PROMPT, "--router", cluster.router_address, "--temperature", "-1"]) == 1
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT: temperature:")
