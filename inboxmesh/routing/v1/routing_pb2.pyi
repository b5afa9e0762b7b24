from inboxmesh.inbox.v1 import inbox_pb2 as _inbox_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_KIND_UNSPECIFIED: _ClassVar[PeerKind]
    PEER_KIND_DM: _ClassVar[PeerKind]
    PEER_KIND_GROUP: _ClassVar[PeerKind]
    PEER_KIND_CHANNEL: _ClassVar[PeerKind]
PEER_KIND_UNSPECIFIED: PeerKind
PEER_KIND_DM: PeerKind
PEER_KIND_GROUP: PeerKind
PEER_KIND_CHANNEL: PeerKind

class Peer(_message.Message):
    __slots__ = ("kind", "id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    kind: PeerKind
    id: str
    def __init__(self, kind: _Optional[_Union[PeerKind, str]] = ..., id: _Optional[str] = ...) -> None: ...

class RouteInput(_message.Message):
    __slots__ = ("channel", "account_id", "peer", "parent_peer", "guild_id", "roles", "team_id")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PARENT_PEER_FIELD_NUMBER: _ClassVar[int]
    GUILD_ID_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    TEAM_ID_FIELD_NUMBER: _ClassVar[int]
    channel: str
    account_id: str
    peer: Peer
    parent_peer: Peer
    guild_id: str
    roles: _containers.RepeatedScalarFieldContainer[str]
    team_id: str
    def __init__(self, channel: _Optional[str] = ..., account_id: _Optional[str] = ..., peer: _Optional[_Union[Peer, _Mapping]] = ..., parent_peer: _Optional[_Union[Peer, _Mapping]] = ..., guild_id: _Optional[str] = ..., roles: _Optional[_Iterable[str]] = ..., team_id: _Optional[str] = ...) -> None: ...

class ResolvedRoute(_message.Message):
    __slots__ = ("agent_id", "channel", "account_id", "session_key", "main_session_key", "matched_by", "binding_index", "warning", "config_version")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    MAIN_SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BY_FIELD_NUMBER: _ClassVar[int]
    BINDING_INDEX_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    channel: str
    account_id: str
    session_key: str
    main_session_key: str
    matched_by: str
    binding_index: int
    warning: str
    config_version: str
    def __init__(self, agent_id: _Optional[str] = ..., channel: _Optional[str] = ..., account_id: _Optional[str] = ..., session_key: _Optional[str] = ..., main_session_key: _Optional[str] = ..., matched_by: _Optional[str] = ..., binding_index: _Optional[int] = ..., warning: _Optional[str] = ..., config_version: _Optional[str] = ...) -> None: ...

class IngressRequest(_message.Message):
    __slots__ = ("source", "message_id", "text", "author", "headers")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    source: RouteInput
    message_id: str
    text: str
    author: str
    headers: _containers.ScalarMap[str, str]
    def __init__(self, source: _Optional[_Union[RouteInput, _Mapping]] = ..., message_id: _Optional[str] = ..., text: _Optional[str] = ..., author: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ...) -> None: ...

class IngressResponse(_message.Message):
    __slots__ = ("route", "session_agent_id", "session_created", "receipt")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    SESSION_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_CREATED_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    route: ResolvedRoute
    session_agent_id: str
    session_created: bool
    receipt: _inbox_pb2.Receipt
    def __init__(self, route: _Optional[_Union[ResolvedRoute, _Mapping]] = ..., session_agent_id: _Optional[str] = ..., session_created: bool = ..., receipt: _Optional[_Union[_inbox_pb2.Receipt, _Mapping]] = ...) -> None: ...

class ResolveRouteRequest(_message.Message):
    __slots__ = ("source",)
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    source: RouteInput
    def __init__(self, source: _Optional[_Union[RouteInput, _Mapping]] = ...) -> None: ...

class Identity(_message.Message):
    __slots__ = ("name", "emoji", "avatar", "avatar_url", "theme")
    NAME_FIELD_NUMBER: _ClassVar[int]
    EMOJI_FIELD_NUMBER: _ClassVar[int]
    AVATAR_FIELD_NUMBER: _ClassVar[int]
    AVATAR_URL_FIELD_NUMBER: _ClassVar[int]
    THEME_FIELD_NUMBER: _ClassVar[int]
    name: str
    emoji: str
    avatar: str
    avatar_url: str
    theme: str
    def __init__(self, name: _Optional[str] = ..., emoji: _Optional[str] = ..., avatar: _Optional[str] = ..., avatar_url: _Optional[str] = ..., theme: _Optional[str] = ...) -> None: ...

class ToolsPolicy(_message.Message):
    __slots__ = ("restricted", "allow", "deny", "send_to")
    RESTRICTED_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    DENY_FIELD_NUMBER: _ClassVar[int]
    SEND_TO_FIELD_NUMBER: _ClassVar[int]
    restricted: bool
    allow: _containers.RepeatedScalarFieldContainer[str]
    deny: _containers.RepeatedScalarFieldContainer[str]
    send_to: str
    def __init__(self, restricted: bool = ..., allow: _Optional[_Iterable[str]] = ..., deny: _Optional[_Iterable[str]] = ..., send_to: _Optional[str] = ...) -> None: ...

class SubagentPolicy(_message.Message):
    __slots__ = ("allow_agents", "model", "model_fallbacks", "max_spawn_depth", "max_children_per_agent")
    ALLOW_AGENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPAWN_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CHILDREN_PER_AGENT_FIELD_NUMBER: _ClassVar[int]
    allow_agents: _containers.RepeatedScalarFieldContainer[str]
    model: str
    model_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    max_spawn_depth: int
    max_children_per_agent: int
    def __init__(self, allow_agents: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., model_fallbacks: _Optional[_Iterable[str]] = ..., max_spawn_depth: _Optional[int] = ..., max_children_per_agent: _Optional[int] = ...) -> None: ...

class ConfiguredAgent(_message.Message):
    __slots__ = ("id", "name", "identity", "is_default", "model", "model_fallbacks", "workspace", "skills", "all_skills", "tools", "subagents")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_FIELD_NUMBER: _ClassVar[int]
    SKILLS_FIELD_NUMBER: _ClassVar[int]
    ALL_SKILLS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    SUBAGENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    identity: Identity
    is_default: bool
    model: str
    model_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    workspace: str
    skills: _containers.RepeatedScalarFieldContainer[str]
    all_skills: bool
    tools: ToolsPolicy
    subagents: SubagentPolicy
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ..., is_default: bool = ..., model: _Optional[str] = ..., model_fallbacks: _Optional[_Iterable[str]] = ..., workspace: _Optional[str] = ..., skills: _Optional[_Iterable[str]] = ..., all_skills: bool = ..., tools: _Optional[_Union[ToolsPolicy, _Mapping]] = ..., subagents: _Optional[_Union[SubagentPolicy, _Mapping]] = ...) -> None: ...

class ModelProvider(_message.Message):
    __slots__ = ("id", "base_url", "api_key_env", "timeout_s", "tool_choice")
    ID_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_ENV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    id: str
    base_url: str
    api_key_env: str
    timeout_s: float
    tool_choice: str
    def __init__(self, id: _Optional[str] = ..., base_url: _Optional[str] = ..., api_key_env: _Optional[str] = ..., timeout_s: _Optional[float] = ..., tool_choice: _Optional[str] = ...) -> None: ...

class ListConfiguredAgentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListConfiguredAgentsResponse(_message.Message):
    __slots__ = ("default_id", "main_key", "dm_scope", "agents", "providers", "config_version", "reload_error")
    DEFAULT_ID_FIELD_NUMBER: _ClassVar[int]
    MAIN_KEY_FIELD_NUMBER: _ClassVar[int]
    DM_SCOPE_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    PROVIDERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    RELOAD_ERROR_FIELD_NUMBER: _ClassVar[int]
    default_id: str
    main_key: str
    dm_scope: str
    agents: _containers.RepeatedCompositeFieldContainer[ConfiguredAgent]
    providers: _containers.RepeatedCompositeFieldContainer[ModelProvider]
    config_version: str
    reload_error: str
    def __init__(self, default_id: _Optional[str] = ..., main_key: _Optional[str] = ..., dm_scope: _Optional[str] = ..., agents: _Optional[_Iterable[_Union[ConfiguredAgent, _Mapping]]] = ..., providers: _Optional[_Iterable[_Union[ModelProvider, _Mapping]]] = ..., config_version: _Optional[str] = ..., reload_error: _Optional[str] = ...) -> None: ...

class ClaimSessionRequest(_message.Message):
    __slots__ = ("session_key",)
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    def __init__(self, session_key: _Optional[str] = ...) -> None: ...

class ClaimSessionResponse(_message.Message):
    __slots__ = ("session_agent_id", "credential", "agent_config_id")
    SESSION_AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    AGENT_CONFIG_ID_FIELD_NUMBER: _ClassVar[int]
    session_agent_id: str
    credential: str
    agent_config_id: str
    def __init__(self, session_agent_id: _Optional[str] = ..., credential: _Optional[str] = ..., agent_config_id: _Optional[str] = ...) -> None: ...
