"""RequestState: what the client gets of the workers' tokens, per completion (stop strings, usage,
logprobs cut with the tokens) and best_of's release of the best n at the end."""

from __future__ import annotations

import types

import pytest

from distserve.engine.model_loader import load_tokenizer
from distserve.request_types import FinishReason, SamplingParams
from distserve.v1 import common_pb2
from services.router.request_state import Completion, RequestState
from services.router.text_stream import TextStream


class _Counter:
    def labels(self, **_):
        return self

    def inc(self, *_):
        pass

    def observe(self, *_):
        pass


METRICS = types.SimpleNamespace(itl=_Counter(), generation_tokens=_Counter(), success=_Counter(), e2e=_Counter())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def state(tokenizer, num_completions: int, num_returned: int, stop: tuple[str, ...] = ()) -> RequestState:
    completions = [Completion(TextStream(tokenizer, stop)) for _ in range(num_completions)]
    return RequestState("r", [5, 6], SamplingParams(stop=stop), completions, 0.0, METRICS,
                        num_returned=num_returned)


def entry(token: int, logprob: float) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=token, logprob=logprob, rank=1)


def test_each_completion_has_its_own_text_finish_and_usage(tokenizer):
    req = state(tokenizer, 2, 2)
    req.chunk([300, 301], None, index=1)
    first = req.chunk([400], FinishReason.LENGTH, index=0)
    assert not req.all_finished and first.usage.completion_tokens == 1 and first.index == 0
    last = req.chunk([302], FinishReason.STOP, index=1)
    assert req.all_finished and last.usage.completion_tokens == 3 and last.usage.prompt_tokens == 2
    assert req.completions[1].outputs == [300, 301, 302]


def test_a_stop_string_cuts_tokens_and_their_logprobs(tokenizer):
    stop_text = tokenizer.decode([301])
    req = state(tokenizer, 1, 1, stop=(stop_text,))
    message = req.chunk([300, 301, 302], None, [entry(300, -1.0), entry(301, -2.0), entry(302, -3.0)])
    assert message.finish_reason == common_pb2.FINISH_REASON_STOP
    assert list(message.token_ids) == [300, 301] and [e.token_id for e in message.logprobs] == [300, 301]
    assert stop_text not in message.text and req.completions[0].cumulative_logprob == -3.0


def test_best_of_releases_the_highest_cumulative_logprob_first_with_the_requests_extras(tokenizer):
    req = state(tokenizer, 3, 2)
    messages = [req.chunk([300 + i], None, [entry(300 + i, lp)], index=i) for i, lp in enumerate((-5.0, -1.0, -3.0))]
    messages[0].prefill_worker, messages[0].prompt_text = "prefill-0", "the prompt"
    for message in messages:
        assert req.released(message) == []  # nothing before every completion has finished
    finals = [req.chunk([310 + i], FinishReason.LENGTH, [entry(310 + i, -0.5)], index=i) for i in range(2)]
    assert all(req.released(m) == [] for m in finals)
    out = req.released(req.chunk([312], FinishReason.LENGTH, [entry(312, -0.5)], index=2))
    assert [(m.index, list(m.token_ids)) for m in out] == [(0, [301]), (0, [311]), (1, [302]), (1, [312])]
    assert out[0].prefill_worker == "prefill-0" and out[0].prompt_text == "the prompt"
    assert sum(m.usage.completion_tokens for m in out) == 6  # the dropped completion's 2 tokens count too
    assert not messages[0].prefill_worker  # moved, not copied: the dropped completion keeps no extras


def test_without_best_of_every_message_passes_at_once(tokenizer):
    req = state(tokenizer, 2, 2)
    message = req.chunk([300], None, index=1)
    assert req.released(message) == [message]


def test_a_resumed_request_sends_only_what_follows_and_ends_like_an_unbroken_one(tokenizer):
    ids = tokenizer("Once upon a time, there was a stop here and more", add_special_tokens=False)["input_ids"]
    whole = state(tokenizer, 1, 1, stop=("stop",))
    unbroken = [whole.chunk([t], None) for t in ids]
    for cut in range(1, len(ids)):
        resumed = state(tokenizer, 1, 1, stop=("stop",))
        resumed.resume(ids[:cut])
        if resumed.completions[0].text.stopped:
            break  # an unbroken stream would have ended before this cut
        rest = [resumed.chunk([t], None) for t in ids[cut:]]
        assert "".join(m.text for m in unbroken[:cut]) + "".join(m.text for m in rest) == \
            "".join(m.text for m in unbroken), cut
        assert [m.finish_reason for m in rest][-1] == unbroken[-1].finish_reason
        assert resumed.outputs[:cut] == ids[:cut]
