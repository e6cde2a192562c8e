"""One request as the router streams it: its n completions' text, tokens and finish, and the messages
the client gets (stop strings cut, usage on each completion's last message, best_of held back).

The servicer (server.py) moves the request between workers; everything about what the client sees
of the workers' tokens is here.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from opentelemetry import trace

from distserve.convert import finish_to_proto
from distserve.request_types import FinishReason, SamplingParams
from distserve.metrics import RouterMetrics
from distserve.prefix_index import PromptBlocks
from distserve.v1 import common_pb2, router_pb2
from services.router.text_stream import TextStream

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Completion:
    """One of the request's n completions, as streamed to the client."""

    text: TextStream
    outputs: list[int] = dataclasses.field(default_factory=list)  # completion tokens streamed so far
    finish: FinishReason | None = None
    cumulative_logprob: float = 0.0  # of the tokens streamed (when logprobs are computed)
    held: list[router_pb2.GenerateResponse] = dataclasses.field(default_factory=list)  # best_of: until chosen


@dataclasses.dataclass
class RequestState:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    completions: list[Completion]
    started: float
    metrics: RouterMetrics
    num_returned: int = 1  # n: completions the client gets (best_of: the best n of len(completions))
    last_message_at: float = 0.0
    num_retries: int = 0
    failed_decode_workers: set[str] = dataclasses.field(default_factory=set)  # retries pick others first
    timings: common_pb2.Timings = dataclasses.field(default_factory=common_pb2.Timings)
    echo_text: str | None = None  # the prompt text to send back on the first message (echo)
    strip_logprobs: bool = False  # computed only to rank best_of completions: not sent
    num_cached_tokens: int = 0  # prompt tokens the first prefill took from a prefix cache (usage.cached_tokens)
    expected_cached_tokens: int = 0  # of the current route's prompt, cached on its worker as routing expected
    _blocks: PromptBlocks | None = dataclasses.field(default=None, repr=False)

    def prompt_blocks(self, model: str, deployment_seed: str) -> PromptBlocks:
        """The block keys of what a prefill would compute now: the prompt plus the completion so far
        (a migrated request's), under the request's cache_salt (model, deployment_seed: PromptBlocks')."""
        tokens = self.prompt + self.outputs if self.outputs else self.prompt
        if self._blocks is None or len(self._blocks.token_ids) != len(tokens):
            self._blocks = PromptBlocks(model, tokens, self.params.cache_salt, deployment_seed)
        return self._blocks

    def answered_blocks(self, model: str, deployment_seed: str) -> PromptBlocks:
        """The block keys of the prompt and the answer (its last token's KV is never written): what a
        worker keeps cached once the stream ends, a chat's next turn's prefix."""
        return PromptBlocks(model, self.prompt + self.outputs[:-1], self.params.cache_salt, deployment_seed)

    def resume(self, token_ids: list[int]) -> None:
        """Continues a stream another router began: its tokens count as sent (their text too, so what
        follows decodes and meets stop strings as it would have), and its prompt extras were sent."""
        completion = self.completions[0]
        completion.outputs.extend(token_ids)
        completion.text.add(token_ids)
        self.echo_text = None

    @property
    def outputs(self) -> list[int]:
        """The first completion's tokens so far (a migrated request has one completion)."""
        return self.completions[0].outputs

    @property
    def all_finished(self) -> bool:
        return all(c.finish is not None for c in self.completions)

    def add_prompt_fields(self, message: router_pb2.GenerateResponse, prompt_logprobs) -> None:
        """The first message's prompt extras: echo and prompt logprobs."""
        message.prompt_logprobs.extend(prompt_logprobs)
        if self.echo_text is not None:
            message.prompt_text = self.echo_text
            message.prompt_token_ids.extend(self.prompt)

    def chunk(self, token_ids: list[int], finish: FinishReason | None, logprobs=(),
              index: int = 0) -> router_pb2.GenerateResponse:
        """The client's message for completion `index`'s tokens from a worker (logprobs: parallel to
        them, or empty); tokens after a stop string are dropped, with their logprobs."""
        completion = self.completions[index]
        now = time.monotonic()
        if self.last_message_at and token_ids:
            for _ in token_ids:
                self.metrics.itl.observe((now - self.last_message_at) / len(token_ids))
        self.last_message_at = now
        if completion.text.has_stop_strings:
            text, kept = "", []
            for token in token_ids:  # one at a time: tokens after a stop string are not part of the answer
                kept.append(token)
                text += completion.text.add([token])
                if completion.text.stopped:
                    finish = FinishReason.STOP
                    break
            token_ids, logprobs = kept, list(logprobs)[:len(kept)]
        else:  # nothing can stop the text mid-message: one decode for all of it
            text = completion.text.add(token_ids)
        completion.outputs.extend(token_ids)
        completion.cumulative_logprob += sum(entry.logprob for entry in logprobs)
        self.metrics.generation_tokens.inc(len(token_ids))
        if finish is not None:
            text += completion.text.flush()
        message = router_pb2.GenerateResponse(request_id=self.request_id, token_ids=token_ids, text=text,
                                              finish_reason=finish_to_proto(finish), index=index,
                                              logprobs=[] if self.strip_logprobs else logprobs)
        if finish is not None:
            completion.finish = finish
            self._finish(completion, message)
        return message

    def _finish(self, completion: Completion, message: router_pb2.GenerateResponse) -> None:
        """Usage (this completion's tokens) and timings on its last message; the request's metrics, span
        attributes and log line once its last completion finishes."""
        message.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(self.prompt),
                                                completion_tokens=len(completion.outputs),
                                                cached_tokens=self.num_cached_tokens))
        message.timings.CopyFrom(self.timings)
        self.metrics.success.labels(finished_reason=completion.finish.value).inc()
        if not self.all_finished:
            return
        e2e_s = time.monotonic() - self.started
        self.metrics.e2e.observe(e2e_s)
        num_tokens = sum(len(c.outputs) for c in self.completions)
        reasons = [c.finish.value for c in self.completions]
        trace.get_current_span().set_attributes({"gen_ai.usage.output_tokens": num_tokens,
                                                 "gen_ai.response.finish_reasons": reasons})
        log.info("finish request_id=%s reason=%s completion_tokens=%d e2e_s=%.4f", self.request_id,
                 ",".join(reasons), num_tokens, e2e_s)

    def released(self, message: router_pb2.GenerateResponse) -> list[router_pb2.GenerateResponse]:
        """What the client gets of a message: itself, or with best_of, nothing until every completion
        has finished, then the n with the highest cumulative logprob, in that order as indexes 0..n-1.
        The tokens of the completions not returned count in the last one's usage: they were generated
        (and are billed, as in OpenAI's API)."""
        if len(self.completions) == self.num_returned:
            return [message]
        self.completions[message.index].held.append(message)
        if not self.all_finished:
            return []
        ranked = sorted(range(len(self.completions)), key=lambda i: -self.completions[i].cumulative_logprob)
        released = [held for new_index, old_index in enumerate(ranked[:self.num_returned])
                    for held in _reindexed(self.completions[old_index].held, new_index)]
        _move_extras(self.completions[0].held[0], released[0])
        released[-1].usage.completion_tokens += sum(len(self.completions[i].outputs)
                                                    for i in ranked[self.num_returned:])
        return released


def _reindexed(messages: list[router_pb2.GenerateResponse], index: int) -> list[router_pb2.GenerateResponse]:
    for message in messages:
        message.index = index
    return messages


_EXTRAS = ("prefill_worker", "decode_worker", "prompt_text", "prompt_token_ids", "prompt_logprobs")


def _move_extras(first: router_pb2.GenerateResponse, to: router_pb2.GenerateResponse) -> None:
    """The request's extras ride on the first message the client gets (best_of may release another first)."""
    if to is first:
        return
    to.prefill_worker, to.decode_worker, to.prompt_text = first.prefill_worker, first.decode_worker, first.prompt_text
    to.prompt_token_ids.extend(first.prompt_token_ids)
    to.prompt_logprobs.extend(first.prompt_logprobs)
    for field in _EXTRAS:
        first.ClearField(field)
