from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_AGENT_REGISTERED: _ClassVar[EventKind]
    EVENT_KIND_AGENT_CLOSED: _ClassVar[EventKind]
    EVENT_KIND_MESSAGE_SENT: _ClassVar[EventKind]
    EVENT_KIND_MESSAGE_STORED: _ClassVar[EventKind]
    EVENT_KIND_MESSAGE_DELIVERED: _ClassVar[EventKind]
    EVENT_KIND_MESSAGE_CONSUMED: _ClassVar[EventKind]
    EVENT_KIND_MESSAGE_DEAD_LETTERED: _ClassVar[EventKind]
    EVENT_KIND_SUBSCRIBED: _ClassVar[EventKind]
    EVENT_KIND_UNSUBSCRIBED: _ClassVar[EventKind]
    EVENT_KIND_NOTICE_UNDELIVERED: _ClassVar[EventKind]
    EVENT_KIND_IOA_PUBLISHED: _ClassVar[EventKind]
    EVENT_KIND_IOA_RECEIVED: _ClassVar[EventKind]
    EVENT_KIND_IOA_DUPLICATE: _ClassVar[EventKind]
    EVENT_KIND_IOA_HELD: _ClassVar[EventKind]
    EVENT_KIND_IOA_GAP: _ClassVar[EventKind]
    EVENT_KIND_IOA_OUTBOXED: _ClassVar[EventKind]
    EVENT_KIND_IOA_OUTBOX_DONE: _ClassVar[EventKind]
    EVENT_KIND_AGENT_SPAWNED: _ClassVar[EventKind]
    EVENT_KIND_AGENT_WOKEN: _ClassVar[EventKind]
    EVENT_KIND_TURN_STARTED: _ClassVar[EventKind]
    EVENT_KIND_TURN_ENDED: _ClassVar[EventKind]
    EVENT_KIND_TASK_COMPLETED: _ClassVar[EventKind]
    EVENT_KIND_RUN_CANCELLED: _ClassVar[EventKind]
    EVENT_KIND_AGENT_IDLE: _ClassVar[EventKind]
    EVENT_KIND_TASK_FAILED: _ClassVar[EventKind]
    EVENT_KIND_MODEL_CALLED: _ClassVar[EventKind]
    EVENT_KIND_RUN_CREATED: _ClassVar[EventKind]
    EVENT_KIND_RUN_STARTED: _ClassVar[EventKind]
    EVENT_KIND_RUN_ENDED: _ClassVar[EventKind]
    EVENT_KIND_RUN_ANNOUNCED: _ClassVar[EventKind]
    EVENT_KIND_RUN_ANNOUNCE_DEFERRED: _ClassVar[EventKind]
    EVENT_KIND_RUN_REQUESTER_GONE: _ClassVar[EventKind]
    EVENT_KIND_RUN_CLEANED_UP: _ClassVar[EventKind]
    EVENT_KIND_RUN_ARCHIVED: _ClassVar[EventKind]
    EVENT_KIND_LIMIT_REFUSED: _ClassVar[EventKind]
    EVENT_KIND_ROUTED: _ClassVar[EventKind]
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_AGENT_REGISTERED: EventKind
EVENT_KIND_AGENT_CLOSED: EventKind
EVENT_KIND_MESSAGE_SENT: EventKind
EVENT_KIND_MESSAGE_STORED: EventKind
EVENT_KIND_MESSAGE_DELIVERED: EventKind
EVENT_KIND_MESSAGE_CONSUMED: EventKind
EVENT_KIND_MESSAGE_DEAD_LETTERED: EventKind
EVENT_KIND_SUBSCRIBED: EventKind
EVENT_KIND_UNSUBSCRIBED: EventKind
EVENT_KIND_NOTICE_UNDELIVERED: EventKind
EVENT_KIND_IOA_PUBLISHED: EventKind
EVENT_KIND_IOA_RECEIVED: EventKind
EVENT_KIND_IOA_DUPLICATE: EventKind
EVENT_KIND_IOA_HELD: EventKind
EVENT_KIND_IOA_GAP: EventKind
EVENT_KIND_IOA_OUTBOXED: EventKind
EVENT_KIND_IOA_OUTBOX_DONE: EventKind
EVENT_KIND_AGENT_SPAWNED: EventKind
EVENT_KIND_AGENT_WOKEN: EventKind
EVENT_KIND_TURN_STARTED: EventKind
EVENT_KIND_TURN_ENDED: EventKind
EVENT_KIND_TASK_COMPLETED: EventKind
EVENT_KIND_RUN_CANCELLED: EventKind
EVENT_KIND_AGENT_IDLE: EventKind
EVENT_KIND_TASK_FAILED: EventKind
EVENT_KIND_MODEL_CALLED: EventKind
EVENT_KIND_RUN_CREATED: EventKind
EVENT_KIND_RUN_STARTED: EventKind
EVENT_KIND_RUN_ENDED: EventKind
EVENT_KIND_RUN_ANNOUNCED: EventKind
EVENT_KIND_RUN_ANNOUNCE_DEFERRED: EventKind
EVENT_KIND_RUN_REQUESTER_GONE: EventKind
EVENT_KIND_RUN_CLEANED_UP: EventKind
EVENT_KIND_RUN_ARCHIVED: EventKind
EVENT_KIND_LIMIT_REFUSED: EventKind
EVENT_KIND_ROUTED: EventKind

class Event(_message.Message):
    __slots__ = ("event_id", "at_us", "kind", "agent_id", "message_id", "sender", "recipient", "sequence", "detail", "trace_id", "turn", "in_reply_to", "conversation_id")
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    AT_US_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    RECIPIENT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    IN_REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: int
    at_us: int
    kind: EventKind
    agent_id: str
    message_id: str
    sender: str
    recipient: str
    sequence: int
    detail: str
    trace_id: str
    turn: int
    in_reply_to: str
    conversation_id: str
    def __init__(self, event_id: _Optional[int] = ..., at_us: _Optional[int] = ..., kind: _Optional[_Union[EventKind, str]] = ..., agent_id: _Optional[str] = ..., message_id: _Optional[str] = ..., sender: _Optional[str] = ..., recipient: _Optional[str] = ..., sequence: _Optional[int] = ..., detail: _Optional[str] = ..., trace_id: _Optional[str] = ..., turn: _Optional[int] = ..., in_reply_to: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class EventFilter(_message.Message):
    __slots__ = ("message_id", "sender", "agent_id", "kinds")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    sender: str
    agent_id: str
    kinds: _containers.RepeatedScalarFieldContainer[EventKind]
    def __init__(self, message_id: _Optional[str] = ..., sender: _Optional[str] = ..., agent_id: _Optional[str] = ..., kinds: _Optional[_Iterable[_Union[EventKind, str]]] = ...) -> None: ...

class ListEventsRequest(_message.Message):
    __slots__ = ("filter", "after_event_id", "limit")
    FILTER_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    filter: EventFilter
    after_event_id: int
    limit: int
    def __init__(self, filter: _Optional[_Union[EventFilter, _Mapping]] = ..., after_event_id: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("filter", "after_event_id", "from_now")
    FILTER_FIELD_NUMBER: _ClassVar[int]
    AFTER_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_NOW_FIELD_NUMBER: _ClassVar[int]
    filter: EventFilter
    after_event_id: int
    from_now: bool
    def __init__(self, filter: _Optional[_Union[EventFilter, _Mapping]] = ..., after_event_id: _Optional[int] = ..., from_now: bool = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class RecordEventsRequest(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class RecordEventsResponse(_message.Message):
    __slots__ = ("event_ids",)
    EVENT_IDS_FIELD_NUMBER: _ClassVar[int]
    event_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, event_ids: _Optional[_Iterable[int]] = ...) -> None: ...
