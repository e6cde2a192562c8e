"""A typed Python client for the router's public API (`distserve.v1.RouterService`).

    async with DistServeClient("127.0.0.1:50051") as client:
        async for chunk in client.generate("Once upon a time", max_tokens=32, temperature=0):
            print(chunk.text, end="", flush=True)
        completion = await client.complete([5, 6, 7], Sampling(max_tokens=8, temperature=0.8, seed=1))

A call's lifecycle: request sent -> chunks (the first as soon as prefill produced a token; each
completion's last one has finish_reason, usage and timings) -> the router ends the stream.
Stopping early (leaving the `async for`, `aclose()` on the iterator, cancelling the task, closing
the client) cancels the call, and the router then cancels the workers. A failed call raises
DistServeError. `DistServeSyncClient` offers the same on a blocking channel.

Sampling is the engine's SamplingParams, sent with distserve.convert: one mapping to the wire. Its
defaults are the router's (max_tokens 16, temperature 1: pass temperature=0 for greedy).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

import grpc

from distserve.bearer_key import call_metadata, key_from_env
from distserve.convert import finish_from_proto, sampling_to_proto
from distserve.request_types import TokenLogprobs
from distserve.request_types import FinishReason
from distserve.request_types import SamplingParams as Sampling
from distserve.grpc_server import PLAINTEXT, TlsConfig, aio_channel, blocking_channel
from distserve.v1 import common_pb2, router_pb2, router_pb2_grpc

__all__ = ["Chunk", "Choice", "Completion", "DistServeClient", "DistServeError", "DistServeSyncClient",
           "FinishReason", "Sampling", "Timings", "TlsConfig", "Tokenized", "TokenLogprobs", "Usage"]


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class Timings:
    """Per-request stage durations in seconds, as the router reports them (common.proto Timings)."""

    queue_s: float
    prefill_s: float
    transfer_s: float
    first_token_s: float
    decode_s: float
    decode_queue_s: float


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One streamed message: new tokens of completion `index` and their text."""

    request_id: str
    index: int
    token_ids: list[int]
    text: str  # the text of token_ids (stop strings cut out; may lag a partial character)
    finish_reason: FinishReason | None  # None while completion `index` is still running
    usage: Usage | None  # on a completion's last chunk: the prompt and this completion's tokens
    timings: Timings | None  # on a completion's last chunk
    logprobs: list[TokenLogprobs]  # parallel to token_ids, when Sampling.logprobs is set
    prompt_logprobs: list[TokenLogprobs]  # first chunk, when Sampling.prompt_logprobs is set
    prompt_text: str  # first chunk, with echo
    prompt_token_ids: list[int]  # first chunk, with echo
    prefill_worker: str
    decode_worker: str


@dataclasses.dataclass(frozen=True)
class Choice:
    """One completion: all chunks of one index, joined."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    logprobs: list[TokenLogprobs]


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole answer; `text`, `token_ids` and `finish_reason` are those of the first choice."""

    request_id: str
    choices: list[Choice]  # by index
    usage: Usage | None  # the prompt's tokens and the choices' completion tokens together
    timings: Timings | None  # from the last chunk that carried timings
    prompt_logprobs: list[TokenLogprobs]
    prompt_text: str
    prompt_token_ids: list[int]
    prefill_worker: str
    decode_worker: str

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.choices[0].finish_reason


@dataclasses.dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    token_strs: list[str]  # each token as text, when asked for
    max_model_len: int


class DistServeError(Exception):
    """A failed call: the gRPC status code and the router's message.

    INVALID_ARGUMENT messages read "field: why"; `field` is that field (e.g. "sampling.top_p" or "prompt").
    """

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, error: grpc.RpcError) -> DistServeError:
        return cls(error.code(), error.details() or "")

    @property
    def field(self) -> str | None:
        if self.code != grpc.StatusCode.INVALID_ARGUMENT or ":" not in self.message:
            return None
        return self.message.split(":", 1)[0]


def build_request(prompt: str | Sequence[int], sampling: Sampling | None = None, *, n: int = 1,
                  best_of: int | None = None, echo: bool = False, user: str = "", request_id: str | None = None,
                  **params: Any) -> router_pb2.GenerateRequest:
    """The GenerateRequest for these arguments; `params` are Sampling fields overriding `sampling`'s
    (TypeError for a name Sampling lacks). Values are checked by the router, not here."""
    sampling = dataclasses.replace(sampling or Sampling(), **params)
    request = router_pb2.GenerateRequest(request_id=request_id or "", sampling=sampling_to_proto(sampling), n=n,
                                         best_of=best_of or 0, echo=echo, user=user)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def _logprobs(messages: Iterable[common_pb2.TokenLogprobs]) -> list[TokenLogprobs]:
    return [TokenLogprobs(m.token_id, m.logprob, m.rank, tuple(m.top_token_ids), tuple(m.top_logprobs))
            for m in messages]


def chunk_from_proto(message: router_pb2.GenerateResponse) -> Chunk:
    usage = Usage(message.usage.prompt_tokens, message.usage.completion_tokens) if message.HasField("usage") else None
    t = message.timings
    timings = (Timings(t.queue_s, t.prefill_s, t.transfer_s, t.first_token_s, t.decode_s, t.decode_queue_s)
               if message.HasField("timings") else None)
    return Chunk(request_id=message.request_id, index=message.index, token_ids=list(message.token_ids),
                 text=message.text, finish_reason=finish_from_proto(message.finish_reason), usage=usage,
                 timings=timings, logprobs=_logprobs(message.logprobs),
                 prompt_logprobs=_logprobs(message.prompt_logprobs), prompt_text=message.prompt_text,
                 prompt_token_ids=list(message.prompt_token_ids), prefill_worker=message.prefill_worker,
                 decode_worker=message.decode_worker)


def join_chunks(chunks: Iterable[Chunk]) -> Completion:
    """Joins a call's chunks per index; fields sent once (prompt, workers) are taken where set."""
    chunks = list(chunks)
    by_index: dict[int, list[Chunk]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)

    def last(name: str, empty: Any = None) -> Any:
        return next((getattr(c, name) for c in reversed(chunks) if getattr(c, name)), empty)

    choices = [_choice(i, by_index[i]) for i in sorted(by_index)]
    usages = [c.usage for c in choices if c.usage]
    usage = Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages)) if usages else None
    return Completion(request_id=last("request_id", ""), choices=choices, usage=usage, timings=last("timings"),
                      prompt_logprobs=last("prompt_logprobs", []), prompt_text=last("prompt_text", ""),
                      prompt_token_ids=last("prompt_token_ids", []),
                      prefill_worker=last("prefill_worker", ""), decode_worker=last("decode_worker", ""))


def _choice(index: int, chunks: list[Chunk]) -> Choice:
    return Choice(index, [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                  chunks[-1].finish_reason, chunks[-1].usage, [e for c in chunks for e in c.logprobs])


@contextlib.contextmanager
def _as_distserve_errors() -> Iterator[None]:
    try:
        yield
    except grpc.RpcError as exc:  # grpc.aio.AioRpcError too
        raise DistServeError.from_rpc(exc) from None


def _tokenize_request(text: str, add_special_tokens: bool, return_token_strs: bool) -> router_pb2.TokenizeRequest:
    return router_pb2.TokenizeRequest(text=text, add_special_tokens=add_special_tokens,
                                      return_token_strs=return_token_strs)


def _tokenized(reply: router_pb2.TokenizeResponse) -> Tokenized:
    return Tokenized(list(reply.token_ids), list(reply.token_strs), reply.max_model_len)


class DistServeClient:
    """An asyncio client of one router; `async with` it, or call close(). Every call, a whole stream
    included, has a deadline of timeout_s (None: none). With `tls`, the channel presents its client
    certificate (mutual TLS, as every distserve service requires when the cluster runs with TLS)."""

    def __init__(self, address: str, tls: TlsConfig | None = None, timeout_s: float | None = None,
                 api_key: str | None = None):
        """api_key: the key a router started with one wants (default: DISTSERVE_API_KEY, if set)."""
        self._channel = aio_channel(address, tls or PLAINTEXT)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = call_metadata(key_from_env() if api_key is None else api_key)

    async def __aenter__(self) -> DistServeClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the channel, cancelling calls still running."""
        await self._channel.close()

    async def generate(self, prompt: str | Sequence[int], sampling: Sampling | None = None, *, n: int = 1,
                       best_of: int | None = None, echo: bool = False, user: str = "",
                       request_id: str | None = None, **params: Any) -> AsyncIterator[Chunk]:
        """Streams the answer chunk by chunk. `params` are Sampling fields (max_tokens=..., temperature=...)
        overriding `sampling`'s; n, best_of, echo and user are GenerateRequest's (router.proto)."""
        request = build_request(prompt, sampling, n=n, best_of=best_of, echo=echo, user=user,
                                request_id=request_id, **params)
        call = self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata)
        try:
            with _as_distserve_errors():
                async for message in call:
                    yield chunk_from_proto(message)
        finally:
            call.cancel()  # a no-op once the stream has ended

    async def complete(self, prompt: str | Sequence[int], sampling: Sampling | None = None, **kwargs: Any
                       ) -> Completion:
        """The whole answer: `generate`'s chunks (same arguments), joined per index."""
        return join_chunks([chunk async for chunk in self.generate(prompt, sampling, **kwargs)])

    async def tokenize(self, text: str, *, add_special_tokens: bool = True, return_token_strs: bool = False
                       ) -> Tokenized:
        """The token ids the router makes of this text prompt."""
        with _as_distserve_errors():
            reply = await self._stub.Tokenize(_tokenize_request(text, add_special_tokens, return_token_strs),
                                              timeout=self._timeout_s, metadata=self._metadata)
        return _tokenized(reply)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        with _as_distserve_errors():
            reply = await self._stub.Detokenize(router_pb2.DetokenizeRequest(token_ids=token_ids),
                                                timeout=self._timeout_s, metadata=self._metadata)
        return reply.text


class DistServeSyncClient:
    """DistServeClient's calls on a blocking channel (scripts, threads); `with` it, or call close().
    Leaving a `for` over generate() early, or close() on its iterator, cancels the call."""

    def __init__(self, address: str, tls: TlsConfig | None = None, timeout_s: float | None = None,
                 api_key: str | None = None):
        """api_key: the key a router started with one wants (default: DISTSERVE_API_KEY, if set)."""
        self._channel = blocking_channel(address, tls or PLAINTEXT)
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._metadata = call_metadata(key_from_env() if api_key is None else api_key)

    def __enter__(self) -> DistServeSyncClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, prompt: str | Sequence[int], sampling: Sampling | None = None, *, n: int = 1,
                 best_of: int | None = None, echo: bool = False, user: str = "", request_id: str | None = None,
                 **params: Any) -> Iterator[Chunk]:
        request = build_request(prompt, sampling, n=n, best_of=best_of, echo=echo, user=user,
                                request_id=request_id, **params)
        call = self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata)
        try:
            with _as_distserve_errors():
                yield from map(chunk_from_proto, call)
        finally:
            call.cancel()

    def complete(self, prompt: str | Sequence[int], sampling: Sampling | None = None, **kwargs: Any) -> Completion:
        return join_chunks(self.generate(prompt, sampling, **kwargs))

    def tokenize(self, text: str, *, add_special_tokens: bool = True, return_token_strs: bool = False) -> Tokenized:
        with _as_distserve_errors():
            return _tokenized(self._stub.Tokenize(_tokenize_request(text, add_special_tokens, return_token_strs),
                                                  timeout=self._timeout_s, metadata=self._metadata))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        with _as_distserve_errors():
            return self._stub.Detokenize(router_pb2.DetokenizeRequest(token_ids=token_ids),
                                         timeout=self._timeout_s, metadata=self._metadata).text
