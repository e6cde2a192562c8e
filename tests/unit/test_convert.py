"""Wire <-> engine conversions: every SamplingParams field survives the round trip; unset means default."""

from __future__ import annotations

import dataclasses

import pytest

from distserve.convert import sampling_from_proto, sampling_to_proto
from distserve.engine.structured import StructuredSpec
from distserve.request_types import SamplingParams
from distserve.v1 import common_pb2


def test_every_sampling_field_round_trips():
    # float32-exact values, since the wire carries floats
    params = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.75, top_k=4, seed=2**63 + 5, stop=("a", "bc"),
                            stop_token_ids=(3, 4), ignore_eos=True, min_tokens=2, repetition_penalty=1.25,
                            presence_penalty=-0.5, frequency_penalty=1.5, min_p=0.0625, logprobs=0,
                            prompt_logprobs=3, structured=StructuredSpec("choice", ("a", "b")), cache_salt="t-1",
                            logit_bias=((3, -100.0), (7, 0.5), (50256, 100.0)))
    assert all(getattr(params, f.name) != f.default for f in dataclasses.fields(SamplingParams))
    assert sampling_from_proto(sampling_to_proto(params)) == params


@pytest.mark.parametrize("spec", [StructuredSpec("json_schema", '{"type": "integer"}'), StructuredSpec("json_object"),
                                  StructuredSpec("regex", "a+"), StructuredSpec("grammar", 'root ::= "a"')])
def test_every_structured_kind_round_trips(spec):
    params = SamplingParams(structured=spec)
    assert sampling_from_proto(sampling_to_proto(params)) == params


def test_an_empty_message_reads_as_the_defaults():
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams()
    assert params.repetition_penalty == 1.0 and not params.has_penalties  # not proto3's 0


def test_explicit_zero_penalties_stay_zero_and_a_zero_repetition_penalty_reaches_validation():
    msg = common_pb2.SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, repetition_penalty=0.0)
    assert msg.HasField("repetition_penalty")
    params = sampling_from_proto(msg)
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (0.0, 0.0, 0.0)
    assert params.repetition_penalty == 0.0  # set, so not replaced by the default; the router rejects it


def test_logit_bias_reads_as_pairs_sorted_by_token_id_whatever_the_map_order():
    forward = sampling_from_proto(common_pb2.SamplingParams(logit_bias={9: 1.5, 2: -3.0, 5: 0.0}))
    backward = sampling_from_proto(common_pb2.SamplingParams(logit_bias={5: 0.0, 2: -3.0, 9: 1.5}))
    assert forward.logit_bias == ((2, -3.0), (5, 0.0), (9, 1.5))
    assert forward == backward and hash(forward) == hash(backward)
    assert dict(sampling_to_proto(forward).logit_bias) == {2: -3.0, 5: 0.0, 9: 1.5}
