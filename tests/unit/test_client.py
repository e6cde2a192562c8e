"""distserve.client against an in-process fake router: request building, reading answers, error mapping,
cancellation and TLS. The real router is tests/integration/test_client.py's."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from distserve.client import (Chunk, Completion, DistServeClient, DistServeError, DistServeSyncClient, FinishReason,
                              Sampling, TokenLogprobs, Usage, build_request, chunk_from_proto, join_chunks)
from distserve.convert import sampling_from_proto
from distserve.dev_certs import make_dev_certs
from distserve.grpc_server import PLAINTEXT, TlsConfig, bind
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc


# --- request and answer conversion ------------------------------------------


def test_sampling_and_keyword_arguments_map_one_to_one_to_the_request():
    sampling = Sampling(max_tokens=7, temperature=0.5, top_p=0.75, top_k=3, seed=11, stop=("\n",),
                        stop_token_ids=(2,), ignore_eos=True, min_tokens=1, repetition_penalty=1.25,
                        presence_penalty=0.5, frequency_penalty=-0.5, min_p=0.125, logprobs=2, prompt_logprobs=0,
                        logit_bias=((4, -1.5), (8, 100.0)))
    request = build_request("hi", sampling, n=2, best_of=3, echo=True, user="u1", request_id="r1", max_tokens=9)
    assert request.text == "hi" and request.WhichOneof("prompt") == "text"
    assert (request.n, request.best_of, request.echo, request.user, request.request_id) == (2, 3, True, "u1", "r1")
    assert sampling_from_proto(request.sampling) == Sampling(**{**sampling.__dict__, "max_tokens": 9})


def test_token_prompts_and_defaults():
    request = build_request([5, 6, 7])
    assert list(request.token_ids.ids) == [5, 6, 7] and request.WhichOneof("prompt") == "token_ids"
    assert (request.n, request.best_of, request.echo, request.user, request.request_id) == (1, 0, False, "", "")
    assert sampling_from_proto(request.sampling) == Sampling()
    assert not request.sampling.HasField("seed") and not request.sampling.HasField("logprobs")


def test_unknown_sampling_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="max_token"):
        build_request("hi", max_token=3)


def test_out_of_range_values_are_left_for_the_router_to_refuse():
    assert build_request("hi", top_p=1.5, temperature=-1).sampling.top_p == 1.5


def test_chunks_carry_typed_finish_usage_timings_and_logprobs():
    running = chunk_from_proto(router_pb2.GenerateResponse(request_id="r", token_ids=[4], text="a"))
    assert running.finish_reason is None and running.usage is None and running.timings is None
    last = chunk_from_proto(router_pb2.GenerateResponse(
        request_id="r", index=1, token_ids=[4, 5], text="ab", finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2), timings=common_pb2.Timings(prefill_s=0.5),
        logprobs=[common_pb2.TokenLogprobs(token_id=4, logprob=-0.5, rank=1, top_token_ids=[4], top_logprobs=[-0.5]),
                  common_pb2.TokenLogprobs(token_id=5, logprob=-2.0, rank=2)]))
    assert last.finish_reason is FinishReason.LENGTH and last.index == 1
    assert last.usage == Usage(3, 2) and last.timings.prefill_s == 0.5
    assert last.logprobs == [TokenLogprobs(4, -0.5, 1, (4,), (-0.5,)), TokenLogprobs(5, -2.0, 2)]


def chunk(index: int, ids: list[int], text: str, reason: FinishReason | None = None, **fields) -> Chunk:
    defaults = dict(request_id="r", usage=None, timings=None, logprobs=[], prompt_logprobs=[], prompt_text="",
                    prompt_token_ids=[], prefill_worker="", decode_worker="")
    return Chunk(index=index, token_ids=ids, text=text, finish_reason=reason, **{**defaults, **fields})


def test_join_chunks_joins_each_index_in_order():
    completion = join_chunks([
        chunk(1, [7], "x", prompt_text="p", prompt_token_ids=[1, 2], prefill_worker="pw"),
        chunk(0, [3], "a", decode_worker="dw"),
        chunk(0, [4], "b", FinishReason.STOP, usage=Usage(2, 2)),
        chunk(1, [8], "y", FinishReason.LENGTH, usage=Usage(2, 4)),
    ])
    assert [(c.index, c.token_ids, c.text, c.finish_reason) for c in completion.choices] == [
        (0, [3, 4], "ab", FinishReason.STOP), (1, [7, 8], "xy", FinishReason.LENGTH)]
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("ab", [3, 4], FinishReason.STOP)
    assert [c.usage for c in completion.choices] == [Usage(2, 2), Usage(2, 4)]
    assert completion.usage == Usage(2, 6)  # the prompt once, every choice's completion tokens
    assert (completion.prompt_text, completion.prompt_token_ids) == ("p", [1, 2])
    assert (completion.prefill_worker, completion.decode_worker) == ("pw", "dw")


def test_error_names_the_invalid_field():
    error = DistServeError(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1], got 1.5")
    assert error.field == "top_p" and str(error) == "INVALID_ARGUMENT: top_p: must be in (0, 1], got 1.5"
    assert DistServeError(grpc.StatusCode.UNAVAILABLE, "x: y").field is None


# --- against a fake router ---------------------------------------------------


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    """Prompt "endless" streams until cancelled (setting `cancelled`), "bad" is refused, any other text
    gets two tokens per completion; Tokenize gives one id per character, Detokenize the reverse."""

    def __init__(self):
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):  # noqa: N802 (gRPC's naming)
        if request.text == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "top_p: must be in (0, 1]")
        if request.text == "endless":
            try:
                for i in itertools.count():
                    yield router_pb2.GenerateResponse(request_id="r", token_ids=[i], text=f"{i} ")
                    await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        for index in range(max(request.n, 1)):
            yield router_pb2.GenerateResponse(request_id=request.request_id, index=index, token_ids=[10 + index],
                                              text="a")
            yield router_pb2.GenerateResponse(request_id=request.request_id, index=index, token_ids=[20], text="b",
                                              finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                              usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=2))

    async def Tokenize(self, request, context):  # noqa: N802
        return router_pb2.TokenizeResponse(token_ids=[ord(c) for c in request.text], max_model_len=2048)

    async def Detokenize(self, request, context):  # noqa: N802
        return router_pb2.DetokenizeResponse(text="".join(map(chr, request.token_ids)))


async def start_fake(tls: TlsConfig = PLAINTEXT) -> tuple[grpc.aio.Server, FakeRouter, str]:
    server, fake = grpc.aio.server(), FakeRouter()
    router_pb2_grpc.add_RouterServiceServicer_to_server(fake, server)
    port = bind(server, "127.0.0.1:0", tls)
    await server.start()
    return server, fake, f"127.0.0.1:{port}"


@pytest.fixture
async def fake():
    server, fake, address = await start_fake()
    fake.address = address
    yield fake
    await server.stop(0)


async def test_generate_streams_chunks_and_complete_joins_them(fake):
    async with DistServeClient(fake.address, timeout_s=10) as client:
        chunks = [c async for c in client.generate("hi", n=2, request_id="r7", max_tokens=2)]
        completion = await client.complete("hi", n=2, request_id="r7", max_tokens=2)
    assert [(c.index, c.token_ids) for c in chunks] == [(0, [10]), (0, [20]), (1, [11]), (1, [20])]
    assert completion == join_chunks(chunks)
    assert isinstance(completion, Completion) and completion.request_id == "r7"
    assert [c.token_ids for c in completion.choices] == [[10, 20], [11, 20]]


async def test_a_refused_request_raises_distserve_error_naming_the_field(fake):
    async with DistServeClient(fake.address) as client:
        with pytest.raises(DistServeError) as error:
            await client.complete("bad")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and error.value.field == "top_p"


async def test_an_unreachable_router_is_unavailable():
    async with DistServeClient("127.0.0.1:1", timeout_s=5) as client:
        with pytest.raises(DistServeError) as error:
            await client.tokenize("x")
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


async def test_leaving_the_loop_cancels_the_call(fake):
    async with DistServeClient(fake.address) as client:
        async for c in client.generate("endless"):
            if c.token_ids[0] == 2:
                break
        await asyncio.wait_for(fake.cancelled.wait(), 5)  # before the client closes its channel


async def test_aclose_cancels_the_call(fake):
    async with DistServeClient(fake.address) as client:
        stream = client.generate("endless")
        await anext(stream)
        await stream.aclose()
        await asyncio.wait_for(fake.cancelled.wait(), 5)


async def test_cancelling_the_task_cancels_the_call(fake):
    async with DistServeClient(fake.address) as client:
        first = asyncio.Event()

        async def read():
            async for _ in client.generate("endless"):
                first.set()

        task = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(fake.cancelled.wait(), 5)


async def test_tokenize_and_detokenize(fake):
    async with DistServeClient(fake.address) as client:
        tokens = await client.tokenize("hey")
        assert tokens.token_ids == [104, 101, 121] and tokens.max_model_len == 2048
        assert await client.detokenize(tokens.token_ids) == "hey"


async def test_sync_client_does_the_same_and_leaving_its_loop_cancels(fake):
    def use_sync_client() -> Completion:
        with DistServeSyncClient(fake.address, timeout_s=10) as client:
            for c in client.generate("endless"):
                if c.token_ids[0] == 2:
                    break
            with pytest.raises(DistServeError) as error:
                client.complete("bad")
            assert error.value.field == "top_p"
            assert client.detokenize(client.tokenize("ok").token_ids) == "ok"
            return client.complete([1, 2], max_tokens=2)

    completion = await asyncio.to_thread(use_sync_client)
    assert completion.token_ids == [10, 20] and completion.finish_reason is FinishReason.LENGTH
    await asyncio.wait_for(fake.cancelled.wait(), 5)


async def test_mutual_tls(tmp_path):
    certs = make_dev_certs(tmp_path)
    server, _, address = await start_fake(certs)
    try:
        async with DistServeClient(address, tls=certs, timeout_s=10) as client:
            assert (await client.complete("hi")).text == "ab"
        async with DistServeClient(address, timeout_s=10) as plaintext:
            with pytest.raises(DistServeError) as error:
                await plaintext.complete("hi")
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
