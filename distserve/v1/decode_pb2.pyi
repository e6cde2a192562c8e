from distserve.v1 import common_pb2 as _common_pb2
from distserve.v1 import mux_pb2 as _mux_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "kv_handle_id", "prompt_token_ids", "first_token_id", "sampling", "output_token_ids", "kv_secret", "starts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_SECRET_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_handle_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_secret: str
    starts: _containers.RepeatedCompositeFieldContainer[_common_pb2.CompletionStart]
    def __init__(self, request_id: _Optional[str] = ..., kv_handle_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., kv_secret: _Optional[str] = ..., starts: _Optional[_Iterable[_Union[_common_pb2.CompletionStart, _Mapping]]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "timings", "logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    timings: _common_pb2.Timings
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class GetDecodeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDecodeStatsResponse(_message.Message):
    __slots__ = ("worker_id", "kv_bytes_received", "kv_transfers_received", "num_used_blocks", "num_total_blocks", "num_running", "num_waiting", "max_running")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    kv_bytes_received: int
    kv_transfers_received: int
    num_used_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    max_running: int
    def __init__(self, worker_id: _Optional[str] = ..., kv_bytes_received: _Optional[int] = ..., kv_transfers_received: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., max_running: _Optional[int] = ...) -> None: ...
