"""Conversions between wire messages (distserve.v1) and the engine's dataclasses.

Servers call these at their edge so schedulers and engines never see protobuf.
"""

from __future__ import annotations

from distserve.engine.sampling import FinishReason, SamplingParams
from distserve.v1 import common_pb2

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
    )


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
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg
