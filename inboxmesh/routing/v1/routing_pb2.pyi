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
    __slots__ = ("agent_id", "channel", "account_id", "session_key", "main_session_key", "matched_by", "binding_index", "warning")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    ACCOUNT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    MAIN_SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BY_FIELD_NUMBER: _ClassVar[int]
    BINDING_INDEX_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    channel: str
    account_id: str
    session_key: str
    main_session_key: str
    matched_by: str
    binding_index: int
    warning: str
    def __init__(self, agent_id: _Optional[str] = ..., channel: _Optional[str] = ..., account_id: _Optional[str] = ..., session_key: _Optional[str] = ..., main_session_key: _Optional[str] = ..., matched_by: _Optional[str] = ..., binding_index: _Optional[int] = ..., warning: _Optional[str] = ...) -> None: ...

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

class ConfiguredAgent(_message.Message):
    __slots__ = ("id", "name", "identity", "is_default", "model", "model_fallbacks")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    identity: Identity
    is_default: bool
    model: str
    model_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., identity: _Optional[_Union[Identity, _Mapping]] = ..., is_default: bool = ..., model: _Optional[str] = ..., model_fallbacks: _Optional[_Iterable[str]] = ...) -> None: ...

class ListConfiguredAgentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListConfiguredAgentsResponse(_message.Message):
    __slots__ = ("default_id", "main_key", "dm_scope", "agents")
    DEFAULT_ID_FIELD_NUMBER: _ClassVar[int]
    MAIN_KEY_FIELD_NUMBER: _ClassVar[int]
    DM_SCOPE_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    default_id: str
    main_key: str
    dm_scope: str
    agents: _containers.RepeatedCompositeFieldContainer[ConfiguredAgent]
    def __init__(self, default_id: _Optional[str] = ..., main_key: _Optional[str] = ..., dm_scope: _Optional[str] = ..., agents: _Optional[_Iterable[_Union[ConfiguredAgent, _Mapping]]] = ...) -> None: ...

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
