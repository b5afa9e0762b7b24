from inboxmesh.ioa.v1 import network_pb2 as _network_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RelayStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RelayStatusResponse(_message.Message):
    __slots__ = ("node_id", "network", "connected", "reconnects", "spaces", "forwarded", "received", "duplicates", "held", "holding", "gaps")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    RECONNECTS_FIELD_NUMBER: _ClassVar[int]
    SPACES_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    network: str
    connected: bool
    reconnects: int
    spaces: _containers.RepeatedScalarFieldContainer[str]
    forwarded: int
    received: int
    duplicates: int
    held: int
    holding: int
    gaps: int
    def __init__(self, node_id: _Optional[str] = ..., network: _Optional[str] = ..., connected: bool = ..., reconnects: _Optional[int] = ..., spaces: _Optional[_Iterable[str]] = ..., forwarded: _Optional[int] = ..., received: _Optional[int] = ..., duplicates: _Optional[int] = ..., held: _Optional[int] = ..., holding: _Optional[int] = ..., gaps: _Optional[int] = ...) -> None: ...

class MapAddressRequest(_message.Message):
    __slots__ = ("agent_id", "address")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    address: str
    def __init__(self, agent_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class MapAddressResponse(_message.Message):
    __slots__ = ("address", "ioa", "local_agent_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IOA_FIELD_NUMBER: _ClassVar[int]
    LOCAL_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    ioa: _network_pb2.Address
    local_agent_id: str
    def __init__(self, address: _Optional[str] = ..., ioa: _Optional[_Union[_network_pb2.Address, _Mapping]] = ..., local_agent_id: _Optional[str] = ...) -> None: ...

class SpaceSendRequest(_message.Message):
    __slots__ = ("space", "text")
    SPACE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    space: str
    text: str
    def __init__(self, space: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class SpaceSendResponse(_message.Message):
    __slots__ = ("ioa_message_id", "status", "detail")
    IOA_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ioa_message_id: str
    status: _network_pb2.PublishStatus
    detail: str
    def __init__(self, ioa_message_id: _Optional[str] = ..., status: _Optional[_Union[_network_pb2.PublishStatus, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class SpaceReadRequest(_message.Message):
    __slots__ = ("space", "after_seq", "limit")
    SPACE_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    space: str
    after_seq: int
    limit: int
    def __init__(self, space: _Optional[str] = ..., after_seq: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class SpaceReadResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_network_pb2.IoaMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[_network_pb2.IoaMessage, _Mapping]]] = ...) -> None: ...
