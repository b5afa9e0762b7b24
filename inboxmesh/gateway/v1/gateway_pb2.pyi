from inboxmesh.common.v1 import envelope_pb2 as _envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2 as _inbox_pb2
from inboxmesh.registry.v1 import registry_pb2 as _registry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClaimGatewayRequest(_message.Message):
    __slots__ = ("family",)
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    family: str
    def __init__(self, family: _Optional[str] = ...) -> None: ...

class ClaimGatewayResponse(_message.Message):
    __slots__ = ("agent", "credential")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    agent: _registry_pb2.Agent
    credential: str
    def __init__(self, agent: _Optional[_Union[_registry_pb2.Agent, _Mapping]] = ..., credential: _Optional[str] = ...) -> None: ...

class DeliverRequest(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_envelope_pb2.Envelope]
    def __init__(self, messages: _Optional[_Iterable[_Union[_envelope_pb2.Envelope, _Mapping]]] = ...) -> None: ...

class DeliverResponse(_message.Message):
    __slots__ = ("receipts",)
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    receipts: _containers.RepeatedCompositeFieldContainer[_inbox_pb2.Receipt]
    def __init__(self, receipts: _Optional[_Iterable[_Union[_inbox_pb2.Receipt, _Mapping]]] = ...) -> None: ...
