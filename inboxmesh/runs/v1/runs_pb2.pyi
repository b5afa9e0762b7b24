from inboxmesh.registry.v1 import registry_pb2 as _registry_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATUS_UNSPECIFIED: _ClassVar[RunStatus]
    RUN_STATUS_RUNNING: _ClassVar[RunStatus]
    RUN_STATUS_OK: _ClassVar[RunStatus]
    RUN_STATUS_ERROR: _ClassVar[RunStatus]
    RUN_STATUS_TIMEOUT: _ClassVar[RunStatus]
    RUN_STATUS_CLOSED: _ClassVar[RunStatus]

class AnnounceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ANNOUNCE_STATE_UNSPECIFIED: _ClassVar[AnnounceState]
    ANNOUNCE_STATE_WAITING: _ClassVar[AnnounceState]
    ANNOUNCE_STATE_PENDING: _ClassVar[AnnounceState]
    ANNOUNCE_STATE_ANNOUNCED: _ClassVar[AnnounceState]
    ANNOUNCE_STATE_REQUESTER_GONE: _ClassVar[AnnounceState]
RUN_STATUS_UNSPECIFIED: RunStatus
RUN_STATUS_RUNNING: RunStatus
RUN_STATUS_OK: RunStatus
RUN_STATUS_ERROR: RunStatus
RUN_STATUS_TIMEOUT: RunStatus
RUN_STATUS_CLOSED: RunStatus
ANNOUNCE_STATE_UNSPECIFIED: AnnounceState
ANNOUNCE_STATE_WAITING: AnnounceState
ANNOUNCE_STATE_PENDING: AnnounceState
ANNOUNCE_STATE_ANNOUNCED: AnnounceState
ANNOUNCE_STATE_REQUESTER_GONE: AnnounceState

class SubagentRun(_message.Message):
    __slots__ = ("run_id", "child_id", "requester_id", "requester_origin", "task", "task_message_id", "cleanup", "label", "agent_config_id", "conversation_id", "created_at_us", "started_at_us", "ended_at_us", "status", "result", "deadline_us", "announce_state", "announce_message_id", "announce_sequence", "announced_at_us", "announce_detail", "cleaned_up_at_us", "archive_at_us", "archived_at_us", "archive_after_us", "traceparent")
    class RequesterOriginEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_ORIGIN_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CLEANUP_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    AGENT_CONFIG_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_US_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_US_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_US_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_US_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_STATE_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_AT_US_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    CLEANED_UP_AT_US_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_AT_US_FIELD_NUMBER: _ClassVar[int]
    ARCHIVED_AT_US_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_AFTER_US_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    child_id: str
    requester_id: str
    requester_origin: _containers.ScalarMap[str, str]
    task: str
    task_message_id: str
    cleanup: _registry_pb2.RunCleanup
    label: str
    agent_config_id: str
    conversation_id: str
    created_at_us: int
    started_at_us: int
    ended_at_us: int
    status: RunStatus
    result: str
    deadline_us: int
    announce_state: AnnounceState
    announce_message_id: str
    announce_sequence: int
    announced_at_us: int
    announce_detail: str
    cleaned_up_at_us: int
    archive_at_us: int
    archived_at_us: int
    archive_after_us: int
    traceparent: str
    def __init__(self, run_id: _Optional[str] = ..., child_id: _Optional[str] = ..., requester_id: _Optional[str] = ..., requester_origin: _Optional[_Mapping[str, str]] = ..., task: _Optional[str] = ..., task_message_id: _Optional[str] = ..., cleanup: _Optional[_Union[_registry_pb2.RunCleanup, str]] = ..., label: _Optional[str] = ..., agent_config_id: _Optional[str] = ..., conversation_id: _Optional[str] = ..., created_at_us: _Optional[int] = ..., started_at_us: _Optional[int] = ..., ended_at_us: _Optional[int] = ..., status: _Optional[_Union[RunStatus, str]] = ..., result: _Optional[str] = ..., deadline_us: _Optional[int] = ..., announce_state: _Optional[_Union[AnnounceState, str]] = ..., announce_message_id: _Optional[str] = ..., announce_sequence: _Optional[int] = ..., announced_at_us: _Optional[int] = ..., announce_detail: _Optional[str] = ..., cleaned_up_at_us: _Optional[int] = ..., archive_at_us: _Optional[int] = ..., archived_at_us: _Optional[int] = ..., archive_after_us: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class EndRunRequest(_message.Message):
    __slots__ = ("run_id", "failed", "result")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    failed: bool
    result: str
    def __init__(self, run_id: _Optional[str] = ..., failed: bool = ..., result: _Optional[str] = ...) -> None: ...

class EndRunResponse(_message.Message):
    __slots__ = ("run", "already_ended")
    RUN_FIELD_NUMBER: _ClassVar[int]
    ALREADY_ENDED_FIELD_NUMBER: _ClassVar[int]
    run: SubagentRun
    already_ended: bool
    def __init__(self, run: _Optional[_Union[SubagentRun, _Mapping]] = ..., already_ended: bool = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id", "child_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    child_id: str
    def __init__(self, run_id: _Optional[str] = ..., child_id: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("requester_id", "include_archived", "page_size", "page_token")
    REQUESTER_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_ARCHIVED_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    requester_id: str
    include_archived: bool
    page_size: int
    page_token: str
    def __init__(self, requester_id: _Optional[str] = ..., include_archived: bool = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "next_page_token")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[SubagentRun]
    next_page_token: str
    def __init__(self, runs: _Optional[_Iterable[_Union[SubagentRun, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class SweepRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SweepRunsResponse(_message.Message):
    __slots__ = ("timed_out", "announced", "cleaned_up", "archived")
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_FIELD_NUMBER: _ClassVar[int]
    CLEANED_UP_FIELD_NUMBER: _ClassVar[int]
    ARCHIVED_FIELD_NUMBER: _ClassVar[int]
    timed_out: _containers.RepeatedScalarFieldContainer[str]
    announced: _containers.RepeatedScalarFieldContainer[str]
    cleaned_up: _containers.RepeatedScalarFieldContainer[str]
    archived: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, timed_out: _Optional[_Iterable[str]] = ..., announced: _Optional[_Iterable[str]] = ..., cleaned_up: _Optional[_Iterable[str]] = ..., archived: _Optional[_Iterable[str]] = ...) -> None: ...
