from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MessageKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MESSAGE_KIND_UNSPECIFIED: _ClassVar[MessageKind]
    MESSAGE_KIND_TEXT: _ClassVar[MessageKind]
    MESSAGE_KIND_TASK: _ClassVar[MessageKind]
    MESSAGE_KIND_COMPLETION: _ClassVar[MessageKind]
    MESSAGE_KIND_REPLY: _ClassVar[MessageKind]
    MESSAGE_KIND_CONTROL: _ClassVar[MessageKind]

class OriginKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ORIGIN_KIND_UNSPECIFIED: _ClassVar[OriginKind]
    ORIGIN_KIND_LOCAL: _ClassVar[OriginKind]
    ORIGIN_KIND_IOA: _ClassVar[OriginKind]
    ORIGIN_KIND_MESH: _ClassVar[OriginKind]
    ORIGIN_KIND_CHANNEL: _ClassVar[OriginKind]
    ORIGIN_KIND_A2A: _ClassVar[OriginKind]
MESSAGE_KIND_UNSPECIFIED: MessageKind
MESSAGE_KIND_TEXT: MessageKind
MESSAGE_KIND_TASK: MessageKind
MESSAGE_KIND_COMPLETION: MessageKind
MESSAGE_KIND_REPLY: MessageKind
MESSAGE_KIND_CONTROL: MessageKind
ORIGIN_KIND_UNSPECIFIED: OriginKind
ORIGIN_KIND_LOCAL: OriginKind
ORIGIN_KIND_IOA: OriginKind
ORIGIN_KIND_MESH: OriginKind
ORIGIN_KIND_CHANNEL: OriginKind
ORIGIN_KIND_A2A: OriginKind

class Content(_message.Message):
    __slots__ = ("text", "data", "media_type")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    text: str
    data: bytes
    media_type: str
    def __init__(self, text: _Optional[str] = ..., data: _Optional[bytes] = ..., media_type: _Optional[str] = ...) -> None: ...

class TraceContext(_message.Message):
    __slots__ = ("traceparent", "tracestate")
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    traceparent: str
    tracestate: str
    def __init__(self, traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class Origin(_message.Message):
    __slots__ = ("kind", "ioa_node", "ioa_space", "ioa_message_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    IOA_NODE_FIELD_NUMBER: _ClassVar[int]
    IOA_SPACE_FIELD_NUMBER: _ClassVar[int]
    IOA_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    kind: OriginKind
    ioa_node: str
    ioa_space: str
    ioa_message_id: str
    def __init__(self, kind: _Optional[_Union[OriginKind, str]] = ..., ioa_node: _Optional[str] = ..., ioa_space: _Optional[str] = ..., ioa_message_id: _Optional[str] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("message_id", "sender", "recipient", "kind", "content", "in_reply_to", "conversation_id", "trace", "origin", "hop_count", "trail", "headers", "created_at_us", "expires_at_us", "sequence", "stored_at_us", "delivery_attempt")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    IN_REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    HOP_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRAIL_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_US_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_US_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    sender: str
    recipient: str
    kind: MessageKind
    content: Content
    in_reply_to: str
    conversation_id: str
    trace: TraceContext
    origin: Origin
    hop_count: int
    trail: _containers.RepeatedScalarFieldContainer[str]
    headers: _containers.ScalarMap[str, str]
    created_at_us: int
    expires_at_us: int
    sequence: int
    stored_at_us: int
    delivery_attempt: int
    def __init__(self, message_id: _Optional[str] = ..., sender: _Optional[str] = ..., recipient: _Optional[str] = ..., kind: _Optional[_Union[MessageKind, str]] = ..., content: _Optional[_Union[Content, _Mapping]] = ..., in_reply_to: _Optional[str] = ..., conversation_id: _Optional[str] = ..., trace: _Optional[_Union[TraceContext, _Mapping]] = ..., origin: _Optional[_Union[Origin, _Mapping]] = ..., hop_count: _Optional[int] = ..., trail: _Optional[_Iterable[str]] = ..., headers: _Optional[_Mapping[str, str]] = ..., created_at_us: _Optional[int] = ..., expires_at_us: _Optional[int] = ..., sequence: _Optional[int] = ..., stored_at_us: _Optional[int] = ..., delivery_attempt: _Optional[int] = ...) -> None: ...
