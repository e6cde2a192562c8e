from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DrainRequest(_message.Message):
    __slots__ = ("reason", "grace_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    grace_s: float
    def __init__(self, reason: _Optional[str] = ..., grace_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drain_s", "grace_s", "already_draining")
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    ALREADY_DRAINING_FIELD_NUMBER: _ClassVar[int]
    drain_s: float
    grace_s: float
    already_draining: bool
    def __init__(self, drain_s: _Optional[float] = ..., grace_s: _Optional[float] = ..., already_draining: _Optional[bool] = ...) -> None: ...
