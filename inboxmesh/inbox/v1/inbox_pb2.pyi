from inboxmesh.common.v1 import envelope_pb2 as _envelope_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReceiptStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECEIPT_STATUS_UNSPECIFIED: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_ACCEPTED: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_DUPLICATE: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_UNKNOWN_TARGET: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_TARGET_CLOSED: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_NOT_PERMITTED: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_INBOX_FULL: _ClassVar[ReceiptStatus]
    RECEIPT_STATUS_OUTBOXED: _ClassVar[ReceiptStatus]

class IoaDelivery(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IOA_DELIVERY_DEFAULT: _ClassVar[IoaDelivery]
    IOA_DELIVERY_DIRECT: _ClassVar[IoaDelivery]
    IOA_DELIVERY_OUTBOX: _ClassVar[IoaDelivery]

class SubscriptionEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SUBSCRIPTION_EVENT_KIND_UNSPECIFIED: _ClassVar[SubscriptionEventKind]
    SUBSCRIPTION_EVENT_KIND_ATTACHED: _ClassVar[SubscriptionEventKind]
    SUBSCRIPTION_EVENT_KIND_SUPERSEDED: _ClassVar[SubscriptionEventKind]
    SUBSCRIPTION_EVENT_KIND_CLOSED: _ClassVar[SubscriptionEventKind]
    SUBSCRIPTION_EVENT_KIND_DETACHED: _ClassVar[SubscriptionEventKind]
    SUBSCRIPTION_EVENT_KIND_REFUSED: _ClassVar[SubscriptionEventKind]

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_CONSUMED: _ClassVar[AckStatus]
    ACK_STATUS_ALREADY_CONSUMED: _ClassVar[AckStatus]
    ACK_STATUS_NOT_FOUND: _ClassVar[AckStatus]
    ACK_STATUS_DEAD_LETTERED: _ClassVar[AckStatus]

class MessageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MESSAGE_STATE_UNSPECIFIED: _ClassVar[MessageState]
    MESSAGE_STATE_QUEUED: _ClassVar[MessageState]
    MESSAGE_STATE_DELIVERED: _ClassVar[MessageState]
    MESSAGE_STATE_CONSUMED: _ClassVar[MessageState]
    MESSAGE_STATE_DEAD_LETTERED: _ClassVar[MessageState]
RECEIPT_STATUS_UNSPECIFIED: ReceiptStatus
RECEIPT_STATUS_ACCEPTED: ReceiptStatus
RECEIPT_STATUS_DUPLICATE: ReceiptStatus
RECEIPT_STATUS_UNKNOWN_TARGET: ReceiptStatus
RECEIPT_STATUS_TARGET_CLOSED: ReceiptStatus
RECEIPT_STATUS_NOT_PERMITTED: ReceiptStatus
RECEIPT_STATUS_INBOX_FULL: ReceiptStatus
RECEIPT_STATUS_OUTBOXED: ReceiptStatus
IOA_DELIVERY_DEFAULT: IoaDelivery
IOA_DELIVERY_DIRECT: IoaDelivery
IOA_DELIVERY_OUTBOX: IoaDelivery
SUBSCRIPTION_EVENT_KIND_UNSPECIFIED: SubscriptionEventKind
SUBSCRIPTION_EVENT_KIND_ATTACHED: SubscriptionEventKind
SUBSCRIPTION_EVENT_KIND_SUPERSEDED: SubscriptionEventKind
SUBSCRIPTION_EVENT_KIND_CLOSED: SubscriptionEventKind
SUBSCRIPTION_EVENT_KIND_DETACHED: SubscriptionEventKind
SUBSCRIPTION_EVENT_KIND_REFUSED: SubscriptionEventKind
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_CONSUMED: AckStatus
ACK_STATUS_ALREADY_CONSUMED: AckStatus
ACK_STATUS_NOT_FOUND: AckStatus
ACK_STATUS_DEAD_LETTERED: AckStatus
MESSAGE_STATE_UNSPECIFIED: MessageState
MESSAGE_STATE_QUEUED: MessageState
MESSAGE_STATE_DELIVERED: MessageState
MESSAGE_STATE_CONSUMED: MessageState
MESSAGE_STATE_DEAD_LETTERED: MessageState

class Receipt(_message.Message):
    __slots__ = ("message_id", "recipient", "status", "sequence", "stored_at_us", "detail")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    recipient: str
    status: ReceiptStatus
    sequence: int
    stored_at_us: int
    detail: str
    def __init__(self, message_id: _Optional[str] = ..., recipient: _Optional[str] = ..., status: _Optional[_Union[ReceiptStatus, str]] = ..., sequence: _Optional[int] = ..., stored_at_us: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("messages", "credentials", "sender", "ioa_delivery")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    IOA_DELIVERY_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_envelope_pb2.Envelope]
    credentials: _containers.RepeatedScalarFieldContainer[str]
    sender: str
    ioa_delivery: IoaDelivery
    def __init__(self, messages: _Optional[_Iterable[_Union[_envelope_pb2.Envelope, _Mapping]]] = ..., credentials: _Optional[_Iterable[str]] = ..., sender: _Optional[str] = ..., ioa_delivery: _Optional[_Union[IoaDelivery, str]] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("receipts",)
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    receipts: _containers.RepeatedCompositeFieldContainer[Receipt]
    def __init__(self, receipts: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("credentials", "max_in_flight")
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    credentials: _containers.RepeatedScalarFieldContainer[str]
    max_in_flight: int
    def __init__(self, credentials: _Optional[_Iterable[str]] = ..., max_in_flight: _Optional[int] = ...) -> None: ...

class Deliveries(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_envelope_pb2.Envelope]
    def __init__(self, messages: _Optional[_Iterable[_Union[_envelope_pb2.Envelope, _Mapping]]] = ...) -> None: ...

class SubscriptionEvent(_message.Message):
    __slots__ = ("agent_id", "kind", "detail", "request_id", "error")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    kind: SubscriptionEventKind
    detail: str
    request_id: int
    error: AckError
    def __init__(self, agent_id: _Optional[str] = ..., kind: _Optional[_Union[SubscriptionEventKind, str]] = ..., detail: _Optional[str] = ..., request_id: _Optional[int] = ..., error: _Optional[_Union[AckError, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("at_us",)
    AT_US_FIELD_NUMBER: _ClassVar[int]
    at_us: int
    def __init__(self, at_us: _Optional[int] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("deliveries", "subscription", "heartbeat", "acked", "acked_many")
    DELIVERIES_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    ACKED_MANY_FIELD_NUMBER: _ClassVar[int]
    deliveries: Deliveries
    subscription: SubscriptionEvent
    heartbeat: Heartbeat
    acked: AckResponse
    acked_many: AckManyResponse
    def __init__(self, deliveries: _Optional[_Union[Deliveries, _Mapping]] = ..., subscription: _Optional[_Union[SubscriptionEvent, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., acked: _Optional[_Union[AckResponse, _Mapping]] = ..., acked_many: _Optional[_Union[AckManyResponse, _Mapping]] = ...) -> None: ...

class ConsumeRequest(_message.Message):
    __slots__ = ("subscribe", "ack", "ack_many", "attach", "detach")
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ACK_MANY_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    subscribe: SubscribeRequest
    ack: AckRequest
    ack_many: AckManyRequest
    attach: AttachRequest
    detach: DetachRequest
    def __init__(self, subscribe: _Optional[_Union[SubscribeRequest, _Mapping]] = ..., ack: _Optional[_Union[AckRequest, _Mapping]] = ..., ack_many: _Optional[_Union[AckManyRequest, _Mapping]] = ..., attach: _Optional[_Union[AttachRequest, _Mapping]] = ..., detach: _Optional[_Union[DetachRequest, _Mapping]] = ...) -> None: ...

class AckManyRequest(_message.Message):
    __slots__ = ("acks", "request_id")
    ACKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[AckRequest]
    request_id: int
    def __init__(self, acks: _Optional[_Iterable[_Union[AckRequest, _Mapping]]] = ..., request_id: _Optional[int] = ...) -> None: ...

class AckManyResponse(_message.Message):
    __slots__ = ("request_id", "acks", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    acks: _containers.RepeatedCompositeFieldContainer[AckResponse]
    error: AckError
    def __init__(self, request_id: _Optional[int] = ..., acks: _Optional[_Iterable[_Union[AckResponse, _Mapping]]] = ..., error: _Optional[_Union[AckError, _Mapping]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("credentials", "max_in_flight", "request_id")
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    credentials: _containers.RepeatedScalarFieldContainer[str]
    max_in_flight: int
    request_id: int
    def __init__(self, credentials: _Optional[_Iterable[str]] = ..., max_in_flight: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("agent_ids", "request_id")
    AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    agent_ids: _containers.RepeatedScalarFieldContainer[str]
    request_id: int
    def __init__(self, agent_ids: _Optional[_Iterable[str]] = ..., request_id: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("agent_id", "sequences", "request_id", "turn")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    sequences: _containers.RepeatedScalarFieldContainer[int]
    request_id: int
    turn: int
    def __init__(self, agent_id: _Optional[str] = ..., sequences: _Optional[_Iterable[int]] = ..., request_id: _Optional[int] = ..., turn: _Optional[int] = ...) -> None: ...

class AckResult(_message.Message):
    __slots__ = ("sequence", "message_id", "status")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    message_id: str
    status: AckStatus
    def __init__(self, sequence: _Optional[int] = ..., message_id: _Optional[str] = ..., status: _Optional[_Union[AckStatus, str]] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("results", "agent_id", "request_id", "error")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AckResult]
    agent_id: str
    request_id: int
    error: AckError
    def __init__(self, results: _Optional[_Iterable[_Union[AckResult, _Mapping]]] = ..., agent_id: _Optional[str] = ..., request_id: _Optional[int] = ..., error: _Optional[_Union[AckError, _Mapping]] = ...) -> None: ...

class AckError(_message.Message):
    __slots__ = ("code", "reason", "message", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    code: int
    reason: str
    message: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class MessageKey(_message.Message):
    __slots__ = ("by_sender", "by_inbox")
    BY_SENDER_FIELD_NUMBER: _ClassVar[int]
    BY_INBOX_FIELD_NUMBER: _ClassVar[int]
    by_sender: SenderKey
    by_inbox: InboxKey
    def __init__(self, by_sender: _Optional[_Union[SenderKey, _Mapping]] = ..., by_inbox: _Optional[_Union[InboxKey, _Mapping]] = ...) -> None: ...

class SenderKey(_message.Message):
    __slots__ = ("sender", "message_id")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    sender: str
    message_id: str
    def __init__(self, sender: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class InboxKey(_message.Message):
    __slots__ = ("recipient", "sequence")
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    recipient: str
    sequence: int
    def __init__(self, recipient: _Optional[str] = ..., sequence: _Optional[int] = ...) -> None: ...

class MessageStatus(_message.Message):
    __slots__ = ("envelope", "state", "delivery_attempts", "stored_at_us", "delivered_at_us", "consumed_at_us", "dead_lettered_at_us", "dead_letter_reason")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_AT_US_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTER_REASON_FIELD_NUMBER: _ClassVar[int]
    envelope: _envelope_pb2.Envelope
    state: MessageState
    delivery_attempts: int
    stored_at_us: int
    delivered_at_us: int
    consumed_at_us: int
    dead_lettered_at_us: int
    dead_letter_reason: str
    def __init__(self, envelope: _Optional[_Union[_envelope_pb2.Envelope, _Mapping]] = ..., state: _Optional[_Union[MessageState, str]] = ..., delivery_attempts: _Optional[int] = ..., stored_at_us: _Optional[int] = ..., delivered_at_us: _Optional[int] = ..., consumed_at_us: _Optional[int] = ..., dead_lettered_at_us: _Optional[int] = ..., dead_letter_reason: _Optional[str] = ...) -> None: ...

class GetMessageStatusRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: MessageKey
    def __init__(self, key: _Optional[_Union[MessageKey, _Mapping]] = ...) -> None: ...

class GetMessageStatusResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: MessageStatus
    def __init__(self, status: _Optional[_Union[MessageStatus, _Mapping]] = ...) -> None: ...

class ListDeadLettersRequest(_message.Message):
    __slots__ = ("recipient", "sender", "page_size", "page_token")
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    recipient: str
    sender: str
    page_size: int
    page_token: str
    def __init__(self, recipient: _Optional[str] = ..., sender: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListDeadLettersResponse(_message.Message):
    __slots__ = ("messages", "next_page_token")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[MessageStatus]
    next_page_token: str
    def __init__(self, messages: _Optional[_Iterable[_Union[MessageStatus, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
