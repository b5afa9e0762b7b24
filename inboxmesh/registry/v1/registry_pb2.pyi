from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_MODE_UNSPECIFIED: _ClassVar[AgentMode]
    AGENT_MODE_MAIN: _ClassVar[AgentMode]
    AGENT_MODE_SYNC: _ClassVar[AgentMode]
    AGENT_MODE_ASYNC: _ClassVar[AgentMode]
    AGENT_MODE_FORK: _ClassVar[AgentMode]

class AgentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_STATE_UNSPECIFIED: _ClassVar[AgentState]
    AGENT_STATE_OPEN: _ClassVar[AgentState]
    AGENT_STATE_CLOSED: _ClassVar[AgentState]

class RunCleanup(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_CLEANUP_UNSPECIFIED: _ClassVar[RunCleanup]
    RUN_CLEANUP_KEEP: _ClassVar[RunCleanup]
    RUN_CLEANUP_DELETE: _ClassVar[RunCleanup]
AGENT_MODE_UNSPECIFIED: AgentMode
AGENT_MODE_MAIN: AgentMode
AGENT_MODE_SYNC: AgentMode
AGENT_MODE_ASYNC: AgentMode
AGENT_MODE_FORK: AgentMode
AGENT_STATE_UNSPECIFIED: AgentState
AGENT_STATE_OPEN: AgentState
AGENT_STATE_CLOSED: AgentState
RUN_CLEANUP_UNSPECIFIED: RunCleanup
RUN_CLEANUP_KEEP: RunCleanup
RUN_CLEANUP_DELETE: RunCleanup

class Agent(_message.Message):
    __slots__ = ("agent_id", "name", "mode", "parent_id", "scope_id", "state", "metadata", "created_at_us", "closed_at_us", "close_reason", "inbox_capacity", "depth")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_US_FIELD_NUMBER: _ClassVar[int]
    CLOSED_AT_US_FIELD_NUMBER: _ClassVar[int]
    CLOSE_REASON_FIELD_NUMBER: _ClassVar[int]
    INBOX_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    name: str
    mode: AgentMode
    parent_id: str
    scope_id: str
    state: AgentState
    metadata: _containers.ScalarMap[str, str]
    created_at_us: int
    closed_at_us: int
    close_reason: str
    inbox_capacity: int
    depth: int
    def __init__(self, agent_id: _Optional[str] = ..., name: _Optional[str] = ..., mode: _Optional[_Union[AgentMode, str]] = ..., parent_id: _Optional[str] = ..., scope_id: _Optional[str] = ..., state: _Optional[_Union[AgentState, str]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., created_at_us: _Optional[int] = ..., closed_at_us: _Optional[int] = ..., close_reason: _Optional[str] = ..., inbox_capacity: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class RegisterAgentRequest(_message.Message):
    __slots__ = ("name", "mode", "parent_id", "metadata", "inbox_capacity", "run", "request_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    INBOX_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    mode: AgentMode
    parent_id: str
    metadata: _containers.ScalarMap[str, str]
    inbox_capacity: int
    run: RunSpec
    request_id: str
    def __init__(self, name: _Optional[str] = ..., mode: _Optional[_Union[AgentMode, str]] = ..., parent_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., inbox_capacity: _Optional[int] = ..., run: _Optional[_Union[RunSpec, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class RunSpec(_message.Message):
    __slots__ = ("task", "task_message_id", "cleanup", "label", "run_timeout_s", "agent_config_id", "conversation_id")
    TASK_FIELD_NUMBER: _ClassVar[int]
    TASK_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CLEANUP_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    RUN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    AGENT_CONFIG_ID_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    task: str
    task_message_id: str
    cleanup: RunCleanup
    label: str
    run_timeout_s: int
    agent_config_id: str
    conversation_id: str
    def __init__(self, task: _Optional[str] = ..., task_message_id: _Optional[str] = ..., cleanup: _Optional[_Union[RunCleanup, str]] = ..., label: _Optional[str] = ..., run_timeout_s: _Optional[int] = ..., agent_config_id: _Optional[str] = ..., conversation_id: _Optional[str] = ...) -> None: ...

class RegisterAgentResponse(_message.Message):
    __slots__ = ("agent", "credential", "run_id")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    agent: Agent
    credential: str
    run_id: str
    def __init__(self, agent: _Optional[_Union[Agent, _Mapping]] = ..., credential: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class RegisterChildrenRequest(_message.Message):
    __slots__ = ("children",)
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    children: _containers.RepeatedCompositeFieldContainer[RegisterAgentRequest]
    def __init__(self, children: _Optional[_Iterable[_Union[RegisterAgentRequest, _Mapping]]] = ...) -> None: ...

class RegisterChildrenResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RegisterChildResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RegisterChildResult, _Mapping]]] = ...) -> None: ...

class RegisterChildResult(_message.Message):
    __slots__ = ("registered", "error")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    registered: RegisterAgentResponse
    error: RegistrationError
    def __init__(self, registered: _Optional[_Union[RegisterAgentResponse, _Mapping]] = ..., error: _Optional[_Union[RegistrationError, _Mapping]] = ...) -> None: ...

class RegistrationError(_message.Message):
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

class GetAgentRequest(_message.Message):
    __slots__ = ("agent_id",)
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    def __init__(self, agent_id: _Optional[str] = ...) -> None: ...

class GetAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: Agent
    def __init__(self, agent: _Optional[_Union[Agent, _Mapping]] = ...) -> None: ...

class ResolveAgentRequest(_message.Message):
    __slots__ = ("name", "scope_id", "include_closed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCOPE_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    name: str
    scope_id: str
    include_closed: bool
    def __init__(self, name: _Optional[str] = ..., scope_id: _Optional[str] = ..., include_closed: bool = ...) -> None: ...

class ResolveAgentResponse(_message.Message):
    __slots__ = ("agent",)
    AGENT_FIELD_NUMBER: _ClassVar[int]
    agent: Agent
    def __init__(self, agent: _Optional[_Union[Agent, _Mapping]] = ...) -> None: ...

class ListAgentsRequest(_message.Message):
    __slots__ = ("scope_id", "parent_id", "include_closed", "page_size", "page_token")
    SCOPE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    scope_id: str
    parent_id: str
    include_closed: bool
    page_size: int
    page_token: str
    def __init__(self, scope_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., include_closed: bool = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListAgentsResponse(_message.Message):
    __slots__ = ("agents", "next_page_token")
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    agents: _containers.RepeatedCompositeFieldContainer[Agent]
    next_page_token: str
    def __init__(self, agents: _Optional[_Iterable[_Union[Agent, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CloseAgentRequest(_message.Message):
    __slots__ = ("agent_id", "reason")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    reason: str
    def __init__(self, agent_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CloseAgentResponse(_message.Message):
    __slots__ = ("closed_agent_ids", "dead_lettered")
    CLOSED_AGENT_IDS_FIELD_NUMBER: _ClassVar[int]
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    closed_agent_ids: _containers.RepeatedScalarFieldContainer[str]
    dead_lettered: int
    def __init__(self, closed_agent_ids: _Optional[_Iterable[str]] = ..., dead_lettered: _Optional[int] = ...) -> None: ...
