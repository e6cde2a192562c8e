from distserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandleState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HANDLE_STATE_UNSPECIFIED: _ClassVar[HandleState]
    HANDLE_STATE_READY: _ClassVar[HandleState]
    HANDLE_STATE_CLAIMED: _ClassVar[HandleState]
HANDLE_STATE_UNSPECIFIED: HandleState
HANDLE_STATE_READY: HandleState
HANDLE_STATE_CLAIMED: HandleState

class KvHandle(_message.Message):
    __slots__ = ("handle_id", "request_id", "owner_worker_id", "owner_ucx_address", "layout", "state", "claimed_by", "lease_expires_at", "kv_crc32c", "kv_chunk_crc32c", "kv_chunk_tokens")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BY_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    KV_CRC32C_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNK_CRC32C_FIELD_NUMBER: _ClassVar[int]
    KV_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    request_id: str
    owner_worker_id: str
    owner_ucx_address: str
    layout: _common_pb2.KvLayout
    state: HandleState
    claimed_by: str
    lease_expires_at: float
    kv_crc32c: int
    kv_chunk_crc32c: _containers.RepeatedScalarFieldContainer[int]
    kv_chunk_tokens: int
    def __init__(self, handle_id: _Optional[str] = ..., request_id: _Optional[str] = ..., owner_worker_id: _Optional[str] = ..., owner_ucx_address: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KvLayout, _Mapping]] = ..., state: _Optional[_Union[HandleState, str]] = ..., claimed_by: _Optional[str] = ..., lease_expires_at: _Optional[float] = ..., kv_crc32c: _Optional[int] = ..., kv_chunk_crc32c: _Optional[_Iterable[int]] = ..., kv_chunk_tokens: _Optional[int] = ...) -> None: ...

class RegisterHandleRequest(_message.Message):
    __slots__ = ("handle", "lease_s")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    handle: KvHandle
    lease_s: float
    def __init__(self, handle: _Optional[_Union[KvHandle, _Mapping]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class RegisterHandleResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: KvHandle
    def __init__(self, handle: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class ClaimHandleRequest(_message.Message):
    __slots__ = ("handle_id", "claimant_worker_id", "request_id")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIMANT_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    claimant_worker_id: str
    request_id: str
    def __init__(self, handle_id: _Optional[str] = ..., claimant_worker_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ClaimHandleResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: KvHandle
    def __init__(self, handle: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class ReleaseHandleRequest(_message.Message):
    __slots__ = ("handle_id", "reason", "request_id")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    handle_id: str
    reason: str
    request_id: str
    def __init__(self, handle_id: _Optional[str] = ..., reason: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class ReleaseHandleResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class GetBrokerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetBrokerStatsResponse(_message.Message):
    __slots__ = ("num_registered", "num_claimed", "num_released", "max_request_bytes", "ucx_loaded")
    NUM_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    NUM_CLAIMED_FIELD_NUMBER: _ClassVar[int]
    NUM_RELEASED_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    UCX_LOADED_FIELD_NUMBER: _ClassVar[int]
    num_registered: int
    num_claimed: int
    num_released: int
    max_request_bytes: int
    ucx_loaded: bool
    def __init__(self, num_registered: _Optional[int] = ..., num_claimed: _Optional[int] = ..., num_released: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., ucx_loaded: _Optional[bool] = ...) -> None: ...
