"""Routing configuration: which agents exist, their per-agent settings, and
the bindings that send a channel's messages to an agent. Reading and
validating files lives here; matching lives in services.routing.resolve.

Every problem raises inboxmesh.client.errors.InvalidArgument whose message starts
with the source and the full key path, e.g.
``routing.yaml: bindings[2].match.peer.kind: must be one of dm, group, channel, got 'room'``.
Unknown keys are errors. A YAML null counts as an absent key. Strings are
trimmed and must not be empty (omit the key instead); ingress tokens are
kept as written and never echoed in messages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import yaml

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason

log = logging.getLogger(__name__)

DEFAULT_AGENT_ID = "main"
DEFAULT_ACCOUNT_ID = "default"
ANY = "*"
PEER_KINDS = ("dm", "group", "channel")
DM_SCOPES = ("main", "per-peer", "per-channel-peer")
AGENT_ID_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
TOOL_NAMES = ("spawn_agent", "send_message", "reply", "list_agents", "close_agent", "finish", "wait", "space_send",
              "space_read")
"""The tools an agent host offers (agent_host/tools.py; tests/test_routing_config.py checks they agree):
`tools.allow` and `tools.deny` may name only these."""
BUILT_IN_PROVIDERS = ("openai", "local", "scripted")
"""Model providers every config has (docs/routing.md "Models"): `openai` (OPENAI_BASE_URL, else OpenAI's
own endpoint, key OPENAI_API_KEY), `local` (the project's local model server, started by the host from the
set-up's cache) and `scripted` (deterministic policies, for tests and demos). `models.providers` may
declare more, or override `openai`'s endpoint."""
TOOL_CHOICES = ("auto", "required")


def normalize_agent_id(value: str) -> str:
    """Trim and lower-case an agent id (" Home " -> "home"); does not validate."""
    return value.strip().lower()


@dataclass(frozen=True)
class ModelConfig:
    """A model with the ones to try when it fails, in order."""

    primary: str
    fallbacks: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProviderConfig:
    """An OpenAI-compatible endpoint that model references `<provider>/<model>` name."""

    id: str
    base_url: str | None = None
    """None: the built-in provider's own (openai: OPENAI_BASE_URL, else https://api.openai.com/v1)."""
    api_key_env: str | None = None
    """The name of the environment variable holding the key (never the key itself)."""
    timeout_s: float | None = None
    """Seconds per request; None: the provider's default (60; local: 240)."""
    tool_choice: str | None = None
    """auto or required; None: the provider's default (auto; local: required)."""


@dataclass(frozen=True)
class Identity:
    """How an agent presents itself; every field is optional."""

    name: str | None = None
    emoji: str | None = None
    avatar: str | None = None
    avatar_url: str | None = None
    theme: str | None = None


@dataclass(frozen=True)
class ToolsPolicy:
    """Which tools an agent may call."""

    allow: tuple[str, ...] | None = None
    """Tools allowed; None allows every tool not denied."""
    deny: tuple[str, ...] = ()
    """Tools refused even when allowed."""
    send_to: str | None = None
    """Which targets send_message offers: "team" (a choice of the agent's children and siblings by
    name), "any" (any name, agent id or address); None = as the host decides."""


@dataclass(frozen=True)
class SubagentPolicy:
    """What an agent may spawn."""

    allow_agents: tuple[str, ...] = ()
    """Agent ids it may spawn besides its own; "*" allows any."""
    model: ModelConfig | None = None
    """Model for the runs it spawns; None uses the spawned agent's own model."""
    max_spawn_depth: int = 1
    """How deep a chain of spawns starting at this agent may go (1..10)."""
    max_children_per_agent: int = 5
    """Spawned runs it may have active at once (1..100)."""


@dataclass(frozen=True)
class AgentConfig:
    """One agent with agents.defaults already applied."""

    id: str
    """Normalized id (trimmed, lower-case)."""
    name: str | None = None
    default: bool = False
    """The `default: true` flag as written; RoutingConfig.default_agent_id is the outcome."""
    workspace: str | None = None
    agent_dir: str | None = None
    model: ModelConfig | None = None
    skills: tuple[str, ...] | None = None
    """Skills it may use; None means all."""
    identity: Identity = field(default_factory=Identity)
    subagents: SubagentPolicy = field(default_factory=SubagentPolicy)
    tools: ToolsPolicy = field(default_factory=ToolsPolicy)


@dataclass(frozen=True)
class PeerMatch:
    """A chat partner: kind dm, group or channel, and its id ("*" in a binding: any of that kind)."""

    kind: str
    id: str


@dataclass(frozen=True)
class BindingMatch:
    """Conditions of a binding, normalized. All given conditions must hold."""

    channel: str
    account_id: str | None = None
    """None: only the default account; "*": any account."""
    peer: PeerMatch | None = None
    guild_id: str | None = None
    roles: tuple[str, ...] = ()
    """Member roles, one of which must be present; only with guild_id."""
    team_id: str | None = None


@dataclass(frozen=True)
class Binding:
    """Route messages matching `match` to `agent_id`; `index` is its position in `bindings`."""

    agent_id: str
    match: BindingMatch
    index: int


@dataclass(frozen=True)
class SessionConfig:
    """How session keys are formed (see services.routing.resolve)."""

    main_key: str = "main"
    dm_scope: str = "main"
    """main: all DMs share the main session; per-peer; per-channel-peer."""


@dataclass(frozen=True)
class LoopGuard:
    """Limits that stop agents from messaging each other forever."""

    max_visits: int = 5
    """How many times one agent may appear in a message's causal trail."""
    conversation_budget: int = 200
    """Messages allowed in one conversation."""


@dataclass(frozen=True)
class RoutingConfig:
    """A validated routing configuration."""

    agents: tuple[AgentConfig, ...] = ()
    """agents.list in config order; empty when none are listed."""
    bindings: tuple[Binding, ...] = ()
    """The bindings in config order (resolution tries them tier by tier, in this order within a tier)."""
    default_agent_id: str = DEFAULT_AGENT_ID
    """The first agent with `default: true`, else the first listed, else "main"."""
    session: SessionConfig = field(default_factory=SessionConfig)
    """How session keys are formed."""
    ingress_tokens: tuple[str, ...] = ()
    """Bearer tokens the ingress accepts (ingress.tokens); empty: the ingress is disabled."""
    archive_after_minutes: float = 60.0
    """Ended subagent runs are archived after this long. A mesh-wide setting: services.settings merges it
    into MeshConfig.runs (a flag wins over it)."""
    loop_guard: LoopGuard = field(default_factory=LoopGuard)
    """The loop guard's limits. Mesh-wide settings: services.settings merges them into MeshConfig.limits
    (a flag wins over them)."""
    providers: tuple[ProviderConfig, ...] = ()
    """models.providers in config order (the built-in ones are not listed unless declared)."""
    version: str = ""
    """The config's version (config_version): the same for the same content, whatever the file's format,
    layout or comments. Routing decisions and ListConfiguredAgents carry it."""
    warnings: tuple[str, ...] = ()
    """Problems that do not stop the config from loading."""
    defaults: AgentConfig = field(default_factory=lambda: AgentConfig(id=DEFAULT_AGENT_ID))
    """agents.defaults resolved; what an agent gets when agents.list is empty."""

    def agent(self, agent_id: str) -> AgentConfig | None:
        """The agent with this id (normalized first). With an empty agents.list
        every valid id is an agent carrying the defaults, as in OpenClaw."""
        wanted = normalize_agent_id(agent_id)
        if not self.agents:
            if not AGENT_ID_PATTERN.fullmatch(wanted):
                return None
            return replace(self.defaults, id=wanted, default=wanted == self.default_agent_id)
        return next((agent for agent in self.agents if agent.id == wanted), None)

    def provider(self, provider_id: str) -> ProviderConfig | None:
        """The provider with this id: declared, else built in (with its defaults), else None."""
        declared = next((p for p in self.providers if p.id == provider_id), None)
        if declared is not None:
            return declared
        return ProviderConfig(provider_id) if provider_id in BUILT_IN_PROVIDERS else None

    def may_spawn(self, requester_agent_id: str, target_agent_id: str) -> bool:
        """Whether the requester may spawn a run of the target agent: always its
        own id, else when allowAgents names the target or holds "*". Does not
        check that the target exists."""
        requester = normalize_agent_id(requester_agent_id)
        target = normalize_agent_id(target_agent_id)
        if requester == target:
            return True
        agent = self.agent(requester)
        if agent is None:
            return False
        allowed = agent.subagents.allow_agents
        return ANY in allowed or target in allowed


# ---------------------------------------------------------------- loading


def load_routing_config(path: str | os.PathLike[str]) -> RoutingConfig:
    """Read and validate a .yaml, .yml or .toml routing file."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        _file_error(file, f"unsupported file type {file.suffix or '(none)'!r}; use .yaml, .yml or .toml")
    try:
        raw = file.read_bytes()
    except OSError as exc:
        _file_error(file, f"cannot read: {exc.strerror or exc}", exc)
    try:
        if suffix == ".toml":
            data = tomllib.loads(raw.decode("utf-8"))
        else:
            data = yaml.load(raw, Loader=_UniqueKeyLoader)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, yaml.YAMLError) as exc:
        _file_error(file, f"cannot parse {'TOML' if suffix == '.toml' else 'YAML'}: {exc}", exc)
    except RecursionError:  # the parsers recurse on nesting: a file nested that deep is no routing config
        _file_error(file, f"cannot parse {'TOML' if suffix == '.toml' else 'YAML'}: nested too deeply")
    config = parse_routing_config(data, source=str(file))
    for warning in config.warnings:
        log.warning("%s: %s", file, warning)
    return config


def _file_error(file: Path, problem: str, cause: BaseException | None = None) -> NoReturn:
    raise errors.InvalidArgument(
        f"{file}: {problem}", reason=Reason.BAD_CONFIG_FILE, metadata={"source": str(file)}
    ) from cause


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML
    would keep the last one silently; TOML refuses it too)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable key; construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


# ---------------------------------------------------------------- validation

_TOP_KEYS = ("agents", "bindings", "session", "ingress", "models")
_MODELS_KEYS = ("providers",)
_PROVIDER_KEYS = ("baseUrl", "apiKeyEnv", "timeoutSeconds", "toolChoice")
ENV_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_AGENTS_KEYS = ("defaults", "list")
_DEFAULTS_KEYS = ("model", "workspace", "skills", "tools", "subagents", "loopGuard")
_DEFAULT_SUBAGENT_KEYS = (
    "maxSpawnDepth", "maxChildrenPerAgent", "archiveAfterMinutes", "model", "allowAgents",
)
_LOOP_GUARD_KEYS = ("maxVisits", "conversationBudget")
_AGENT_KEYS = (
    "id", "default", "name", "workspace", "agentDir", "model", "skills", "identity", "subagents", "tools",
)
_AGENT_SUBAGENT_KEYS = ("allowAgents", "model", "maxSpawnDepth", "maxChildrenPerAgent")
_IDENTITY_KEYS = ("name", "emoji", "avatar", "avatarUrl", "theme")
_TOOLS_KEYS = ("allow", "deny", "sendTo")
SEND_TO = ("team", "any")
"""The values of tools.sendTo."""
_MODEL_KEYS = ("primary", "fallbacks")
_BINDING_KEYS = ("agentId", "match")
_MATCH_KEYS = ("channel", "accountId", "peer", "guildId", "roles", "teamId")
_PEER_KEYS = ("kind", "id")
_SESSION_KEYS = ("mainKey", "dmScope")
_INGRESS_KEYS = ("tokens",)


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _snake(key: str) -> str:
    return re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), key)


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Reader:
    """Typed reads from parsed data; every failure names the source and the key path."""

    def __init__(self, source: str):
        self.source = source
        self.warnings: list[str] = []
        self.allow_refs: list[tuple[str, str]] = []  # (path, id) of every allowAgents entry
        self.model_refs: list[tuple[str, str]] = []  # (path, reference) of every model named

    def fail(self, path: str, problem: str, reason: Reason) -> NoReturn:
        where = path or "(top level)"
        raise errors.InvalidArgument(
            f"{self.source}: {where}: {problem}",
            reason=reason,
            metadata={"field": where, "source": self.source},
        )

    def opt(self, data: dict[str, Any], key: str, path: str, read: Callable[..., Any], *args: Any,
            default: Any = None, **kwargs: Any) -> Any:
        """read(data[key]) with the key's path, or default when the key is absent."""
        return read(data[key], _join(path, key), *args, **kwargs) if key in data else default

    def required(self, data: dict[str, Any], key: str, path: str, read: Callable[..., Any],
                 *args: Any) -> Any:
        if key not in data:
            self.fail(_join(path, key), "required key is missing", Reason.MISSING_FIELD)
        return read(data[key], _join(path, key), *args)

    def mapping(self, value: Any, path: str, known: tuple[str, ...]) -> dict[str, Any]:
        """value as a mapping whose keys are all known, without null values; None is empty."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {_show(value)}", Reason.WRONG_TYPE)
        for key in value:
            if key not in known:
                self.fail(_join(path, key), f"unknown key; known keys are {', '.join(known)}", Reason.UNKNOWN_KEY)
        return {key: item for key, item in value.items() if item is not None}

    def section(self, data: dict[str, Any], key: str, path: str, known: tuple[str, ...]) -> dict[str, Any]:
        return self.mapping(data.get(key), _join(path, key), known)

    def items(self, value: Any, path: str) -> list[tuple[str, Any]]:
        if not isinstance(value, list):
            self.fail(path, f"expected a list, got {_show(value)}", Reason.WRONG_TYPE)
        return [(f"{path}[{i}]", item) for i, item in enumerate(value)]

    def string(self, value: Any, path: str, *, secret: bool = False) -> str:
        if not isinstance(value, str):
            got = type(value).__name__ if secret else _show(value)
            hint = " (quote it)" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""
            self.fail(path, f"expected a string, got {got}{hint}", Reason.WRONG_TYPE)
        if not value.strip():
            self.fail(path, "must not be empty; omit the key instead", Reason.BAD_VALUE)
        return value if secret else value.strip()

    def lower(self, value: Any, path: str) -> str:
        return self.string(value, path).lower()

    def strings(self, value: Any, path: str, *, secret: bool = False) -> tuple[str, ...]:
        return tuple(self.string(item, at, secret=secret) for at, item in self.items(value, path))

    def boolean(self, value: Any, path: str) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false, got {_show(value)}", Reason.WRONG_TYPE)
        return value

    def integer(self, value: Any, path: str, low: int, high: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(path, f"expected an integer, got {_show(value)}", Reason.WRONG_TYPE)
        if value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
            self.fail(path, f"must be {bounds}, got {value}", Reason.BAD_VALUE)
        return value

    def positive_number(self, value: Any, path: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            self.fail(path, f"expected a number, got {_show(value)}", Reason.WRONG_TYPE)
        if not math.isfinite(value) or value <= 0:
            self.fail(path, f"must be a finite number greater than 0, got {value}", Reason.BAD_VALUE)
        return float(value)

    def choice(self, value: Any, path: str, choices: tuple[str, ...]) -> str:
        chosen = self.lower(value, path)
        if chosen not in choices:
            self.fail(path, f"must be one of {', '.join(choices)}, got {_show(value)}", Reason.BAD_VALUE)
        return chosen

    def agent_id(self, value: Any, path: str, *, allow_any: bool = False) -> str:
        ident = normalize_agent_id(self.string(value, path))
        if allow_any and ident == ANY:
            return ANY
        if not AGENT_ID_PATTERN.fullmatch(ident):
            self.fail(path, f"{value!r} is not a valid agent id; trimmed and lower-cased it must match "
                      f"^{AGENT_ID_PATTERN.pattern}$", Reason.BAD_AGENT_ID)
        return ident

    def model_ref(self, value: Any, path: str) -> str:
        ref = self.string(value, path)
        self.model_refs.append((path, ref))
        return ref

    def model_refs_list(self, value: Any, path: str) -> tuple[str, ...]:
        return tuple(self.model_ref(item, at) for at, item in self.items(value, path))

    def tool_names(self, value: Any, path: str) -> tuple[str, ...]:
        names = self.strings(value, path)
        for index, name in enumerate(names):
            if name not in TOOL_NAMES:
                self.fail(f"{path}[{index}]", f"unknown tool {_show(name)}; the tools are {', '.join(TOOL_NAMES)}",
                          Reason.UNKNOWN_TOOL)
        return names

    def model(self, value: Any, path: str) -> ModelConfig:
        if isinstance(value, str):
            return ModelConfig(self.model_ref(value, path))
        if not isinstance(value, dict):
            self.fail(path, f"expected a model name or a mapping with primary and fallbacks, "
                      f"got {_show(value)}", Reason.WRONG_TYPE)
        data = self.mapping(value, path, _MODEL_KEYS)
        return ModelConfig(
            self.required(data, "primary", path, self.model_ref),
            self.opt(data, "fallbacks", path, self.model_refs_list, default=()),
        )

    def allow_agents(self, value: Any, path: str) -> tuple[str, ...]:
        ids = tuple(self.agent_id(item, at, allow_any=True) for at, item in self.items(value, path))
        self.allow_refs.extend((f"{path}[{i}]", ident) for i, ident in enumerate(ids))
        return ids


@dataclass(frozen=True)
class _Partial:
    """Settings as written at one level (agents.defaults or one entry); None = not given."""

    workspace: str | None = None
    model: ModelConfig | None = None
    skills: tuple[str, ...] | None = None
    tools_allow: tuple[str, ...] | None = None
    tools_deny: tuple[str, ...] | None = None
    send_to: str | None = None
    allow_agents: tuple[str, ...] | None = None
    subagent_model: ModelConfig | None = None
    max_spawn_depth: int | None = None
    max_children: int | None = None


def _partial(r: _Reader, data: dict[str, Any], path: str, subagent_keys: tuple[str, ...]) -> _Partial:
    tools_path, sub_path = _join(path, "tools"), _join(path, "subagents")
    tools = r.section(data, "tools", path, _TOOLS_KEYS)
    sub = r.section(data, "subagents", path, subagent_keys)
    return _Partial(
        workspace=r.opt(data, "workspace", path, r.string),
        model=r.opt(data, "model", path, r.model),
        skills=r.opt(data, "skills", path, r.strings),
        tools_allow=r.opt(tools, "allow", tools_path, r.tool_names),
        tools_deny=r.opt(tools, "deny", tools_path, r.tool_names),
        send_to=r.opt(tools, "sendTo", tools_path, r.choice, SEND_TO),
        allow_agents=r.opt(sub, "allowAgents", sub_path, r.allow_agents),
        subagent_model=r.opt(sub, "model", sub_path, r.model),
        max_spawn_depth=r.opt(sub, "maxSpawnDepth", sub_path, r.integer, 1, 10),
        max_children=r.opt(sub, "maxChildrenPerAgent", sub_path, r.integer, 1, 100),
    )


def _pick(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _agent(agent_id: str, entry: _Partial, defaults: _Partial, **fields: Any) -> AgentConfig:
    """An AgentConfig where each setting given in the entry overrides the default one."""
    return AgentConfig(
        id=agent_id,
        workspace=_pick(entry.workspace, defaults.workspace),
        model=_pick(entry.model, defaults.model),
        skills=_pick(entry.skills, defaults.skills),
        tools=ToolsPolicy(
            allow=_pick(entry.tools_allow, defaults.tools_allow),
            deny=_pick(entry.tools_deny, defaults.tools_deny, ()),
            send_to=_pick(entry.send_to, defaults.send_to),
        ),
        subagents=SubagentPolicy(
            allow_agents=_pick(entry.allow_agents, defaults.allow_agents, ()),
            model=_pick(entry.subagent_model, defaults.subagent_model),
            max_spawn_depth=_pick(entry.max_spawn_depth, defaults.max_spawn_depth, 1),
            max_children_per_agent=_pick(entry.max_children, defaults.max_children, 5),
        ),
        **fields,
    )


def _agent_entry(r: _Reader, value: Any, path: str, defaults: _Partial) -> AgentConfig:
    data = r.mapping(value, path, _AGENT_KEYS)
    agent_id = r.required(data, "id", path, r.agent_id)
    ident_path = _join(path, "identity")
    ident = r.section(data, "identity", path, _IDENTITY_KEYS)
    return _agent(
        agent_id,
        _partial(r, data, path, _AGENT_SUBAGENT_KEYS),
        defaults,
        name=r.opt(data, "name", path, r.string),
        default=r.opt(data, "default", path, r.boolean, default=False),
        agent_dir=r.opt(data, "agentDir", path, r.string),
        identity=Identity(
            **{_snake(key): r.opt(ident, key, ident_path, r.string) for key in _IDENTITY_KEYS}
        ),
    )


def _peer(r: _Reader, value: Any, path: str) -> PeerMatch:
    data = r.mapping(value, path, _PEER_KEYS)
    kind = r.required(data, "kind", path, r.choice, PEER_KINDS)
    return PeerMatch(kind, r.required(data, "id", path, r.string))


def _binding(r: _Reader, value: Any, path: str, index: int) -> Binding:
    data = r.mapping(value, path, _BINDING_KEYS)
    agent_id = r.required(data, "agentId", path, r.agent_id)
    match_path = _join(path, "match")
    match = r.required(data, "match", path, r.mapping, _MATCH_KEYS)
    guild = r.opt(match, "guildId", match_path, r.string)
    if "roles" in match and guild is None:
        r.fail(_join(match_path, "roles"), "only allowed together with guildId", Reason.CONFLICTING_FIELDS)
    return Binding(
        agent_id=agent_id,
        match=BindingMatch(
            channel=r.required(match, "channel", match_path, r.lower),
            account_id=r.opt(match, "accountId", match_path, r.lower),
            peer=r.opt(match, "peer", match_path, _peer_reader(r)),
            guild_id=guild,
            roles=r.opt(match, "roles", match_path, r.strings, default=()),
            team_id=r.opt(match, "teamId", match_path, r.string),
        ),
        index=index,
    )


def _peer_reader(r: _Reader) -> Callable[[Any, str], PeerMatch]:
    return lambda value, path: _peer(r, value, path)


def _default_agent(r: _Reader, agents: list[AgentConfig]) -> str:
    marked = [i for i, agent in enumerate(agents) if agent.default]
    if len(marked) > 1:
        where = ", ".join(f"agents.list[{i}]" for i in marked)
        r.warnings.append(f"agents.list: several agents are marked default: true ({where}); "
                          f"using {agents[marked[0]].id!r} from agents.list[{marked[0]}]")
    if marked:
        return agents[marked[0]].id
    return agents[0].id if agents else DEFAULT_AGENT_ID


def _agent_list(r: _Reader, value: Any, defaults: _Partial) -> list[AgentConfig]:
    agents: list[AgentConfig] = []
    seen_at: dict[str, str] = {}
    for path, item in r.items(value, "agents.list"):
        agent = _agent_entry(r, item, path, defaults)
        if agent.id in seen_at:
            r.fail(_join(path, "id"), f"duplicate agent id {agent.id!r} (also at {seen_at[agent.id]})",
                   Reason.DUPLICATE_AGENT_ID)
        seen_at[agent.id] = _join(path, "id")
        agents.append(agent)
    return agents


def _warn_unknown_agents(r: _Reader, agents: list[AgentConfig], bindings: tuple[Binding, ...],
                         default_id: str) -> None:
    known = {agent.id for agent in agents}
    if not known:
        return  # with no agents.list every id is an agent (OpenClaw's rule)
    for binding in bindings:
        if binding.agent_id not in known:
            r.warnings.append(f"bindings[{binding.index}].agentId: agent {binding.agent_id!r} is not in "
                              f"agents.list; messages it matches go to the default agent {default_id!r}")
    for path, ident in r.allow_refs:
        if ident != ANY and ident not in known:
            r.warnings.append(f"{path}: agent {ident!r} is not in agents.list")


def _session(r: _Reader, data: dict[str, Any]) -> SessionConfig:
    main_key = r.opt(data, "mainKey", "session", r.lower, default="main")
    if not AGENT_ID_PATTERN.fullmatch(main_key):
        r.fail("session.mainKey", f"{data['mainKey']!r} must match ^{AGENT_ID_PATTERN.pattern}$ once "
               "lower-cased", Reason.BAD_VALUE)
    return SessionConfig(main_key, r.opt(data, "dmScope", "session", r.choice, DM_SCOPES, default="main"))


def config_version(data: dict[str, Any] | None) -> str:
    """The first 12 hex digits of the sha256 of the parsed data in canonical JSON (None counts as {})."""
    canonical = json.dumps(data or {}, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def _providers(r: _Reader, data: dict[str, Any]) -> tuple[ProviderConfig, ...]:
    path = "models.providers"
    section = data.get("providers")
    if section is None:
        return ()
    if not isinstance(section, dict):
        r.fail(path, f"expected a mapping of provider ids to their settings, got {_show(section)}", Reason.WRONG_TYPE)
    providers = []
    for key, value in section.items():
        at = _join(path, key)
        ident = r.lower(key, at) if isinstance(key, str) else r.string(key, at)
        if not AGENT_ID_PATTERN.fullmatch(ident) or ident == "scripted":
            r.fail(at, f"{key!r} is not a provider id (lower-case letters, digits, _ and -; not 'scripted')",
                   Reason.BAD_VALUE)
        entry = r.mapping(value, at, _PROVIDER_KEYS)
        base_url = r.opt(entry, "baseUrl", at, r.string)
        if base_url is not None and not re.match(r"https?://[^\s/]+", base_url):
            r.fail(_join(at, "baseUrl"), f"expected an http:// or https:// URL, got {_show(base_url)}",
                   Reason.BAD_VALUE)
        if base_url is None and ident not in BUILT_IN_PROVIDERS:
            r.fail(_join(at, "baseUrl"), "required key is missing (only the built-in providers have their own)",
                   Reason.MISSING_FIELD)
        key_env = r.opt(entry, "apiKeyEnv", at, r.string, secret=True)
        if key_env is not None and not ENV_NAME_PATTERN.fullmatch(key_env):
            r.fail(_join(at, "apiKeyEnv"), "expected the name of an environment variable (the key itself never goes in"
                   " the file)", Reason.BAD_VALUE)
        providers.append(ProviderConfig(
            id=ident, base_url=base_url, api_key_env=key_env,
            timeout_s=r.opt(entry, "timeoutSeconds", at, r.positive_number),
            tool_choice=r.opt(entry, "toolChoice", at, r.choice, TOOL_CHOICES),
        ))
    return tuple(providers)


def _check_model_refs(r: _Reader, providers: tuple[ProviderConfig, ...]) -> None:
    """Every `<provider>/<model>` names a declared or built-in provider; a bare name is on `openai`."""
    known = {p.id for p in providers} | set(BUILT_IN_PROVIDERS)
    for path, ref in r.model_refs:
        provider, slash, model = ref.partition("/")
        if slash and not model.strip():
            r.fail(path, f"{_show(ref)} names no model after the provider", Reason.BAD_VALUE)
        if slash and provider not in known:
            r.fail(path, f"model {_show(ref)}: provider {provider!r} is not declared in models.providers (built in:"
                   f" {', '.join(BUILT_IN_PROVIDERS)})", Reason.UNKNOWN_PROVIDER)


def parse_routing_config(data: dict[str, Any] | None, source: str = "<config>") -> RoutingConfig:
    """Validate parsed config data (as from YAML or TOML); None is an empty config."""
    r = _Reader(source)
    top = r.mapping(data, "", _TOP_KEYS)
    agents_data = r.section(top, "agents", "", _AGENTS_KEYS)
    defaults_data = r.section(agents_data, "defaults", "agents", _DEFAULTS_KEYS)
    defaults = _partial(r, defaults_data, "agents.defaults", _DEFAULT_SUBAGENT_KEYS)
    sub_path, guard_path = "agents.defaults.subagents", "agents.defaults.loopGuard"
    sub = r.section(defaults_data, "subagents", "agents.defaults", _DEFAULT_SUBAGENT_KEYS)
    guard = r.section(defaults_data, "loopGuard", "agents.defaults", _LOOP_GUARD_KEYS)
    agents = _agent_list(r, agents_data.get("list", []), defaults)
    default_id = _default_agent(r, agents)
    bindings = tuple(
        _binding(r, item, path, index)
        for index, (path, item) in enumerate(r.items(top.get("bindings", []), "bindings"))
    )
    _warn_unknown_agents(r, agents, bindings, default_id)
    session = _session(r, r.section(top, "session", "", _SESSION_KEYS))
    ingress = r.section(top, "ingress", "", _INGRESS_KEYS)
    providers = _providers(r, r.section(top, "models", "", _MODELS_KEYS))
    _check_model_refs(r, providers)
    return RoutingConfig(
        providers=providers,
        version=config_version(data),
        agents=tuple(agents),
        bindings=bindings,
        default_agent_id=default_id,
        session=session,
        ingress_tokens=r.opt(ingress, "tokens", "ingress", r.strings, secret=True, default=()),
        archive_after_minutes=r.opt(sub, "archiveAfterMinutes", sub_path, r.positive_number, default=60.0),
        loop_guard=LoopGuard(
            max_visits=r.opt(guard, "maxVisits", guard_path, r.integer, 1, default=5),
            conversation_budget=r.opt(guard, "conversationBudget", guard_path, r.integer, 1, default=200),
        ),
        warnings=tuple(r.warnings),
        defaults=_agent(DEFAULT_AGENT_ID, _Partial(), defaults),
    )
