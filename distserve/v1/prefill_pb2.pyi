from distserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "kv_handle_id", "output_token_ids", "kv_secret", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SECRET_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    kv_handle_id: str
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_secret: str
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_handle_id: _Optional[str] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., kv_secret: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "finish_reason", "kv_handle_id", "kv_layout", "timings", "first_token_logprobs", "prompt_logprobs", "starts", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    finish_reason: _common_pb2.FinishReason
    kv_handle_id: str
    kv_layout: _common_pb2.KvLayout
    timings: _common_pb2.Timings
    first_token_logprobs: _common_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    starts: _containers.RepeatedCompositeFieldContainer[_common_pb2.CompletionStart]
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv_handle_id: _Optional[str] = ..., kv_layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., starts: _Optional[_Iterable[_Union[_common_pb2.CompletionStart, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class GetPrefillStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPrefillStatsResponse(_message.Message):
    __slots__ = ("worker_id", "kv_bytes_sent", "kv_transfers_sent", "num_held_handles", "held_bytes", "num_waiting", "num_batches", "max_batch_size")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_HANDLES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_bytes_sent: int
    kv_transfers_sent: int
    num_held_handles: int
    held_bytes: int
    num_waiting: int
    num_batches: int
    max_batch_size: int
    def __init__(self, worker_id: _Optional[str] = ..., kv_bytes_sent: _Optional[int] = ..., kv_transfers_sent: _Optional[int] = ..., num_held_handles: _Optional[int] = ..., held_bytes: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_batches: _Optional[int] = ..., max_batch_size: _Optional[int] = ...) -> None: ...
