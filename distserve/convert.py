"""Conversions between wire messages (distserve.v1) and the engine's dataclasses.

Servers call these at their edge so schedulers and engines never see protobuf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distserve.request_types import TokenLogprobs
from distserve.request_types import FinishReason, SamplingParams
from distserve.v1 import common_pb2

if TYPE_CHECKING:
    from distserve.engine.structured import StructuredSpec

_FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO[value]


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Reads the wire form; unset optional fields take SamplingParams' defaults.

    Range checks are the router's (services.router.validation).
    """
    defaults = SamplingParams()

    def optional(name: str):
        return getattr(msg, name) if msg.HasField(name) else getattr(defaults, name)

    return SamplingParams(
        max_tokens=optional("max_tokens"),
        temperature=optional("temperature"),
        top_p=optional("top_p"),
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        repetition_penalty=optional("repetition_penalty"),
        presence_penalty=optional("presence_penalty"),
        frequency_penalty=optional("frequency_penalty"),
        min_p=optional("min_p"),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured=structured_from_proto(msg.structured_output),
        cache_salt=msg.cache_salt,
        logit_bias=tuple(sorted(msg.logit_bias.items())),  # a map has no order: sorted, so equal maps compare equal
    )


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredSpec | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    from distserve.engine.structured import StructuredSpec  # xgrammar loads only for requests that use it
    if kind == "choice":
        return StructuredSpec("choice", tuple(msg.choice.values))
    if kind == "json_object":
        return StructuredSpec("json_object") if msg.json_object else None
    return StructuredSpec(kind, getattr(msg, kind))


def structured_to_proto(spec: StructuredSpec | None) -> common_pb2.StructuredOutput:
    msg = common_pb2.StructuredOutput()
    if spec is None:
        return msg
    if spec.kind == "choice":
        msg.choice.values.extend(spec.value)
    elif spec.kind == "json_object":
        msg.json_object = True
    else:
        setattr(msg, spec.kind, spec.value)
    return msg


def logprobs_to_proto(entry: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
                                    top_token_ids=entry.top_token_ids, top_logprobs=entry.top_logprobs)


def first_logprobs_fields(result) -> dict:
    """A PrefillResult's logprobs as message fields: {"logprobs": [first token's], "prompt_logprobs": [...]},
    each present only when the request asked for it."""
    fields = {}
    if result.first_token_logprobs is not None:
        fields["logprobs"] = [logprobs_to_proto(result.first_token_logprobs)]
    if result.prompt_logprobs is not None:
        fields["prompt_logprobs"] = [logprobs_to_proto(e) for e in result.prompt_logprobs]
    return fields


def starts_to_proto(starts) -> list[common_pb2.CompletionStart]:
    """prefill_batcher.Start list -> CompletionStart messages."""
    messages = []
    for start in starts:
        message = common_pb2.CompletionStart(token_id=start.token, finish_reason=finish_to_proto(start.finish))
        if start.logprobs is not None:
            message.logprobs.CopyFrom(logprobs_to_proto(start.logprobs))
        messages.append(message)
    return messages


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_p=params.min_p,
        cache_salt=params.cache_salt,
        logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured is not None:
        msg.structured_output.CopyFrom(structured_to_proto(params.structured))
    return msg
