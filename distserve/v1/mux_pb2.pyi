from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MuxBatch(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[MuxFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[MuxFrame, _Mapping]]] = ...) -> None: ...

class MuxFrame(_message.Message):
    __slots__ = ("stream_id", "open", "message", "end", "cancel", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    open: bytes
    message: bytes
    end: MuxStatus
    cancel: bool
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, stream_id: _Optional[int] = ..., open: _Optional[bytes] = ..., message: _Optional[bytes] = ..., end: _Optional[_Union[MuxStatus, _Mapping]] = ..., cancel: _Optional[bool] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class MuxStatus(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...
