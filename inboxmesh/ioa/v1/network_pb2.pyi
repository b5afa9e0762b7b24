from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUBLISH_STATUS_UNSPECIFIED: _ClassVar[PublishStatus]
    PUBLISH_STATUS_OK: _ClassVar[PublishStatus]
    PUBLISH_STATUS_UNKNOWN_NODE: _ClassVar[PublishStatus]
    PUBLISH_STATUS_NODE_OFFLINE: _ClassVar[PublishStatus]
    PUBLISH_STATUS_NOT_A_MEMBER: _ClassVar[PublishStatus]
    PUBLISH_STATUS_INVALID: _ClassVar[PublishStatus]

class FaultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_KIND_UNSPECIFIED: _ClassVar[FaultKind]
    FAULT_KIND_DROP_CONNECTION: _ClassVar[FaultKind]
    FAULT_KIND_DUPLICATE: _ClassVar[FaultKind]
    FAULT_KIND_DELAY: _ClassVar[FaultKind]
    FAULT_KIND_REORDER: _ClassVar[FaultKind]
PUBLISH_STATUS_UNSPECIFIED: PublishStatus
PUBLISH_STATUS_OK: PublishStatus
PUBLISH_STATUS_UNKNOWN_NODE: PublishStatus
PUBLISH_STATUS_NODE_OFFLINE: PublishStatus
PUBLISH_STATUS_NOT_A_MEMBER: PublishStatus
PUBLISH_STATUS_INVALID: PublishStatus
FAULT_KIND_UNSPECIFIED: FaultKind
FAULT_KIND_DROP_CONNECTION: FaultKind
FAULT_KIND_DUPLICATE: FaultKind
FAULT_KIND_DELAY: FaultKind
FAULT_KIND_REORDER: FaultKind

class Address(_message.Message):
    __slots__ = ("node", "agent")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent: str
    def __init__(self, node: _Optional[str] = ..., agent: _Optional[str] = ...) -> None: ...

class IoaMessage(_message.Message):
    __slots__ = ("ioa_message_id", "direct", "space", "text", "data", "media_type", "headers", "sent_at_us", "space_seq")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IOA_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_US_FIELD_NUMBER: _ClassVar[int]
    SPACE_SEQ_FIELD_NUMBER: _ClassVar[int]
    ioa_message_id: str
    direct: Address
    space: str
    text: str
    data: bytes
    media_type: str
    headers: _containers.ScalarMap[str, str]
    sent_at_us: int
    space_seq: int
    def __init__(self, ioa_message_id: _Optional[str] = ..., direct: _Optional[_Union[Address, _Mapping]] = ..., space: _Optional[str] = ..., text: _Optional[str] = ..., data: _Optional[bytes] = ..., media_type: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., sent_at_us: _Optional[int] = ..., space_seq: _Optional[int] = ..., **kwargs) -> None: ...

class Hello(_message.Message):
    __slots__ = ("node_id", "batches")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    batches: bool
    def __init__(self, node_id: _Optional[str] = ..., batches: bool = ...) -> None: ...

class Publish(_message.Message):
    __slots__ = ("message", "publish_id")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_ID_FIELD_NUMBER: _ClassVar[int]
    message: IoaMessage
    publish_id: int
    def __init__(self, message: _Optional[_Union[IoaMessage, _Mapping]] = ..., publish_id: _Optional[int] = ...) -> None: ...

class PublishBatch(_message.Message):
    __slots__ = ("publishes",)
    PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    publishes: _containers.RepeatedCompositeFieldContainer[Publish]
    def __init__(self, publishes: _Optional[_Iterable[_Union[Publish, _Mapping]]] = ...) -> None: ...

class JoinSpace(_message.Message):
    __slots__ = ("space",)
    SPACE_FIELD_NUMBER: _ClassVar[int]
    space: str
    def __init__(self, space: _Optional[str] = ...) -> None: ...

class LeaveSpace(_message.Message):
    __slots__ = ("space",)
    SPACE_FIELD_NUMBER: _ClassVar[int]
    space: str
    def __init__(self, space: _Optional[str] = ...) -> None: ...

class NodeFrame(_message.Message):
    __slots__ = ("hello", "publish", "join", "leave", "publish_batch")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_BATCH_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    publish: Publish
    join: JoinSpace
    leave: LeaveSpace
    publish_batch: PublishBatch
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., publish: _Optional[_Union[Publish, _Mapping]] = ..., join: _Optional[_Union[JoinSpace, _Mapping]] = ..., leave: _Optional[_Union[LeaveSpace, _Mapping]] = ..., publish_batch: _Optional[_Union[PublishBatch, _Mapping]] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("publish_id", "status", "detail", "ioa_message_id")
    PUBLISH_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    IOA_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    publish_id: int
    status: PublishStatus
    detail: str
    ioa_message_id: str
    def __init__(self, publish_id: _Optional[int] = ..., status: _Optional[_Union[PublishStatus, str]] = ..., detail: _Optional[str] = ..., ioa_message_id: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("node_id", "redelivering")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REDELIVERING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    redelivering: int
    def __init__(self, node_id: _Optional[str] = ..., redelivering: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("items",)
    class Item(_message.Message):
        __slots__ = ("message", "result", "node_back")
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        RESULT_FIELD_NUMBER: _ClassVar[int]
        NODE_BACK_FIELD_NUMBER: _ClassVar[int]
        message: IoaMessage
        result: PublishResult
        node_back: NodeBack
        def __init__(self, message: _Optional[_Union[IoaMessage, _Mapping]] = ..., result: _Optional[_Union[PublishResult, _Mapping]] = ..., node_back: _Optional[_Union[NodeBack, _Mapping]] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Batch.Item]
    def __init__(self, items: _Optional[_Iterable[_Union[Batch.Item, _Mapping]]] = ...) -> None: ...

class NodeBack(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class NetworkFrame(_message.Message):
    __slots__ = ("welcome", "message", "result", "batch", "node_back")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    NODE_BACK_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    message: IoaMessage
    result: PublishResult
    batch: Batch
    node_back: NodeBack
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., message: _Optional[_Union[IoaMessage, _Mapping]] = ..., result: _Optional[_Union[PublishResult, _Mapping]] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., node_back: _Optional[_Union[NodeBack, _Mapping]] = ...) -> None: ...

class ReadSpaceRequest(_message.Message):
    __slots__ = ("space", "after_seq", "limit")
    SPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    space: str
    after_seq: int
    limit: int
    def __init__(self, space: _Optional[str] = ..., after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ReadSpaceResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[IoaMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[IoaMessage, _Mapping]]] = ...) -> None: ...

class InjectFaultRequest(_message.Message):
    __slots__ = ("node_id", "kind", "count", "delay_ms")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: FaultKind
    count: int
    delay_ms: int
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[_Union[FaultKind, str]] = ..., count: _Optional[int] = ..., delay_ms: _Optional[int] = ...) -> None: ...

class InjectFaultResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NetworkStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "connected", "spaces", "delivered", "connections")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SPACES_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    connected: bool
    spaces: _containers.RepeatedScalarFieldContainer[str]
    delivered: int
    connections: int
    def __init__(self, node_id: _Optional[str] = ..., connected: bool = ..., spaces: _Optional[_Iterable[str]] = ..., delivered: _Optional[int] = ..., connections: _Optional[int] = ...) -> None: ...

class NetworkStatusResponse(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ...) -> None: ...
