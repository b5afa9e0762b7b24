"""Routing configuration: loading YAML and TOML, defaults, normalization, and
validation errors that name the full key path."""

from pathlib import Path
from typing import Any

import pytest

from inboxmesh.client import errors
from services.routing import (
    TOOL_NAMES,
    AgentConfig,
    Binding,
    BindingMatch,
    Identity,
    LoopGuard,
    ModelConfig,
    PeerMatch,
    ProviderConfig,
    SessionConfig,
    SubagentPolicy,
    ToolsPolicy,
    load_routing_config,
    normalize_agent_id,
    parse_routing_config,
)

pytestmark = pytest.mark.store_independent

YAML_CONFIG = """\
models:
  providers:
    anthropic: {baseUrl: "https://api.anthropic.com/v1", apiKeyEnv: ANTHROPIC_API_KEY}
session:
  dmScope: per-peer
ingress:
  tokens: ["tok-1", "tok-2"]
agents:
  defaults:
    model: anthropic/claude-sonnet-4
    tools: {deny: [close_agent]}
    subagents:
      maxSpawnDepth: 2
      archiveAfterMinutes: 30
    loopGuard:
      maxVisits: 3
  list:
    - id: Home
      default: true
      name: Home helper
      identity: {name: Xiaoke, emoji: "\U0001F3E0", avatarUrl: "https://example.test/a.png"}
    - id: work
      workspace: ~/work-projects
      model:
        primary: openai/gpt-4o
        fallbacks: [anthropic/claude-sonnet-4]
      subagents:
        allowAgents: [CODE]
        maxChildrenPerAgent: 2
    - id: code
      skills: [code-review, git]
      tools: {allow: [send_message, reply]}
bindings:
  - agentId: work
    match: {channel: slack, teamId: T01234567}
  - agentId: code
    match: {channel: Discord, guildId: "123456789", roles: [dev]}
  - agentId: home
    match: {channel: telegram, accountId: Personal}
  - agentId: work
    match:
      channel: discord
      accountId: "*"
      peer: {kind: channel, id: " C1 "}
"""

TOML_CONFIG = """\
[models.providers.anthropic]
baseUrl = "https://api.anthropic.com/v1"
apiKeyEnv = "ANTHROPIC_API_KEY"

[session]
dmScope = "per-peer"

[ingress]
tokens = ["tok-1", "tok-2"]

[agents.defaults]
model = "anthropic/claude-sonnet-4"
tools = { deny = ["close_agent"] }

[agents.defaults.subagents]
maxSpawnDepth = 2
archiveAfterMinutes = 30

[agents.defaults.loopGuard]
maxVisits = 3

[[agents.list]]
id = "Home"
default = true
name = "Home helper"
identity = { name = "Xiaoke", emoji = "\U0001F3E0", avatarUrl = "https://example.test/a.png" }

[[agents.list]]
id = "work"
workspace = "~/work-projects"
model = { primary = "openai/gpt-4o", fallbacks = ["anthropic/claude-sonnet-4"] }
subagents = { allowAgents = ["CODE"], maxChildrenPerAgent = 2 }

[[agents.list]]
id = "code"
skills = ["code-review", "git"]
tools = { allow = ["send_message", "reply"] }

[[bindings]]
agentId = "work"
match = { channel = "slack", teamId = "T01234567" }

[[bindings]]
agentId = "code"
match = { channel = "Discord", guildId = "123456789", roles = ["dev"] }

[[bindings]]
agentId = "home"
match = { channel = "telegram", accountId = "Personal" }

[[bindings]]
agentId = "work"
match = { channel = "discord", accountId = "*", peer = { kind = "channel", id = " C1 " } }
"""

DEFAULT_MODEL = ModelConfig("anthropic/claude-sonnet-4")
EXPECTED_AGENTS = (
    AgentConfig(
        id="home",
        name="Home helper",
        default=True,
        model=DEFAULT_MODEL,
        identity=Identity(name="Xiaoke", emoji="\U0001F3E0", avatar_url="https://example.test/a.png"),
        subagents=SubagentPolicy(max_spawn_depth=2, max_children_per_agent=5),
        tools=ToolsPolicy(allow=None, deny=("close_agent",)),
    ),
    AgentConfig(
        id="work",
        workspace="~/work-projects",
        model=ModelConfig("openai/gpt-4o", ("anthropic/claude-sonnet-4",)),
        subagents=SubagentPolicy(allow_agents=("code",), max_spawn_depth=2, max_children_per_agent=2),
        tools=ToolsPolicy(allow=None, deny=("close_agent",)),
    ),
    AgentConfig(
        id="code",
        model=DEFAULT_MODEL,
        skills=("code-review", "git"),
        subagents=SubagentPolicy(max_spawn_depth=2),
        tools=ToolsPolicy(allow=("send_message", "reply"), deny=("close_agent",)),
    ),
)
EXPECTED_BINDINGS = (
    Binding("work", BindingMatch(channel="slack", team_id="T01234567"), 0),
    Binding("code", BindingMatch(channel="discord", guild_id="123456789", roles=("dev",)), 1),
    Binding("home", BindingMatch(channel="telegram", account_id="personal"), 2),
    Binding("work", BindingMatch(channel="discord", account_id="*", peer=PeerMatch("channel", "C1")), 3),
)


@pytest.mark.parametrize(
    "suffix, text",
    [(".yaml", YAML_CONFIG), (".yml", YAML_CONFIG), (".toml", TOML_CONFIG)],
    ids=["yaml", "yml", "toml"],
)
def test_load_file(tmp_path: Path, suffix: str, text: str) -> None:
    path = tmp_path / f"routing{suffix}"
    path.write_text(text, encoding="utf-8")
    cfg = load_routing_config(path)
    assert cfg.agents == EXPECTED_AGENTS
    assert cfg.bindings == EXPECTED_BINDINGS
    assert cfg.default_agent_id == "home"
    assert cfg.session == SessionConfig(main_key="main", dm_scope="per-peer")
    assert cfg.ingress_tokens == ("tok-1", "tok-2")
    assert cfg.archive_after_minutes == 30.0
    assert cfg.loop_guard == LoopGuard(max_visits=3, conversation_budget=200)
    assert cfg.warnings == ()


def test_yaml_and_toml_give_the_same_config(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(YAML_CONFIG, encoding="utf-8")
    (tmp_path / "a.toml").write_text(TOML_CONFIG, encoding="utf-8")
    assert load_routing_config(tmp_path / "a.yaml") == load_routing_config(str(tmp_path / "a.toml"))


@pytest.mark.parametrize("text", ["", "# nothing here\n", "null\n"], ids=["empty", "comment-only", "null"])
def test_empty_yaml_is_an_empty_config(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text, encoding="utf-8")
    cfg = load_routing_config(path)
    assert (cfg.agents, cfg.bindings, cfg.default_agent_id, cfg.warnings) == ((), (), "main", ())
    assert cfg.session == SessionConfig("main", "main")
    assert cfg.loop_guard == LoopGuard(5, 200)
    assert cfg.archive_after_minutes == 60.0


def test_empty_toml_and_none_are_empty_configs(tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text("", encoding="utf-8")
    assert load_routing_config(path) == parse_routing_config(None) == parse_routing_config({})


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("routing.json", "{}", "unsupported file type '.json'; use .yaml, .yml or .toml"),
        ("routing", "", "unsupported file type '(none)'; use .yaml, .yml or .toml"),
    ],
    ids=["json", "no-suffix"],
)
def test_bad_suffix_names_the_path(tmp_path: Path, name: str, text: str, expected: str) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(errors.InvalidArgument) as caught:
        load_routing_config(path)
    assert caught.value.message == f"{path}: {expected}"
    assert caught.value.reason == "BAD_CONFIG_FILE"


@pytest.mark.parametrize(
    "name, text, prefix, detail",
    [
        ("bad.yaml", "agents:\n  list: [unclosed\n", "cannot parse YAML: ", "line 3"),
        ("bad.yml", "agents: {}\nagents: {}\n", "cannot parse YAML: ", "duplicate key 'agents'"),
        ("bad.toml", "[agents\nlist = 1\n", "cannot parse TOML: ", "line 1"),
        ("bad.toml", "[session]\nmainKey = 'a'\nmainKey = 'b'\n", "cannot parse TOML: ", "line 3"),
    ],
    ids=["yaml-syntax", "yaml-duplicate-key", "toml-syntax", "toml-duplicate-key"],
)
def test_unparsable_file_names_path_and_parser_message(
    tmp_path: Path, name: str, text: str, prefix: str, detail: str
) -> None:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(errors.InvalidArgument) as caught:
        load_routing_config(path)
    assert caught.value.message.startswith(f"{path}: {prefix}")
    assert detail in caught.value.message
    assert caught.value.reason == "BAD_CONFIG_FILE"


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(errors.InvalidArgument) as caught:
        load_routing_config(path)
    assert caught.value.message == f"{path}: cannot read: No such file or directory"


def test_validation_error_in_a_file_names_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("agents:\n  list:\n    - id: a\n      modle: x\n", encoding="utf-8")
    with pytest.raises(errors.InvalidArgument) as caught:
        load_routing_config(path)
    assert caught.value.message == (
        f"{path}: agents.list[0].modle: unknown key; known keys are id, default, name, workspace, agentDir, "
        "model, skills, identity, subagents, tools"
    )
    assert caught.value.metadata == {"field": "agents.list[0].modle", "source": str(path)}


def _agents(*entries: object) -> dict:
    return {"agents": {"list": list(entries)}}


def _binding(**match: object) -> dict:
    return {"bindings": [{"agentId": "a", "match": {"channel": "discord", **match}}]}


INVALID = [
    ("unknown-top-key", {"agent": {}},
     "agent: unknown key; known keys are agents, bindings, session, ingress, models", "UNKNOWN_KEY"),
    ("unknown-agent-key", _agents({"id": "a"}, {"id": "b", "modle": "x"}),
     "agents.list[1].modle: unknown key; known keys are id, default, name, workspace, agentDir, model, "
     "skills, identity, subagents, tools", "UNKNOWN_KEY"),
    ("unknown-match-key", _binding(guild="1"),
     "bindings[0].match.guild: unknown key; known keys are channel, accountId, peer, guildId, roles, teamId",
     "UNKNOWN_KEY"),
    ("unknown-identity-key", _agents({"id": "a", "identity": {"color": "red"}}),
     "agents.list[0].identity.color: unknown key; known keys are name, emoji, avatar, avatarUrl, theme",
     "UNKNOWN_KEY"),
    ("archive-only-in-defaults", _agents({"id": "a", "subagents": {"archiveAfterMinutes": 5}}),
     "agents.list[0].subagents.archiveAfterMinutes: unknown key; known keys are allowAgents, model, "
     "maxSpawnDepth, maxChildrenPerAgent", "UNKNOWN_KEY"),
    ("fallback-not-string", _agents({"id": "a"}, {"id": "b", "model": {"primary": "p", "fallbacks": [3]}}),
     "agents.list[1].model.fallbacks[0]: expected a string, got 3 (quote it)", "WRONG_TYPE"),
    ("model-wrong-type", _agents({"id": "a", "model": 7}),
     "agents.list[0].model: expected a model name or a mapping with primary and fallbacks, got 7",
     "WRONG_TYPE"),
    ("model-without-primary", _agents({"id": "a", "model": {"fallbacks": ["x"]}}),
     "agents.list[0].model.primary: required key is missing", "MISSING_FIELD"),
    ("subagent-model-unknown-key",
     {"agents": {"defaults": {"subagents": {"model": {"primary": "p", "fb": []}}}}},
     "agents.defaults.subagents.model.fb: unknown key; known keys are primary, fallbacks", "UNKNOWN_KEY"),
    ("default-not-bool", _agents({"id": "a", "default": "yes"}),
     "agents.list[0].default: expected true or false, got 'yes'", "WRONG_TYPE"),
    ("skills-not-list", _agents({"id": "a", "skills": "git"}),
     "agents.list[0].skills: expected a list, got 'git'", "WRONG_TYPE"),
    ("list-not-list", {"agents": {"list": {"id": "a"}}},
     "agents.list: expected a list, got {'id': 'a'}", "WRONG_TYPE"),
    ("entry-not-mapping", _agents("a"), "agents.list[0]: expected a mapping, got 'a'", "WRONG_TYPE"),
    ("top-level-not-mapping", [1, 2], "(top level): expected a mapping, got [1, 2]", "WRONG_TYPE"),
    ("tools-deny-not-list", _agents({"id": "a", "tools": {"deny": "shell"}}),
     "agents.list[0].tools.deny: expected a list, got 'shell'", "WRONG_TYPE"),
    ("tools-send-to", _agents({"id": "a", "tools": {"sendTo": "everyone"}}),
     "agents.list[0].tools.sendTo: must be one of team, any, got 'everyone'", "BAD_VALUE"),
    ("tools-unknown", _agents({"id": "a", "tools": {"allow": ["send_message", "shell"]}}),
     "agents.list[0].tools.allow[1]: unknown tool 'shell'; the tools are spawn_agent, send_message, reply, list_agents,"
     " close_agent, finish, wait, space_send, space_read", "UNKNOWN_TOOL"),
    ("provider-unknown", _agents({"id": "a", "model": {"primary": "local/qwen", "fallbacks": ["acme/big"]}}),
     "agents.list[0].model.fallbacks[0]: model 'acme/big': provider 'acme' is not declared in models.providers"
     " (built in: openai, local, scripted)", "UNKNOWN_PROVIDER"),
    ("provider-no-model", _agents({"id": "a", "model": "local/ "}),
     "agents.list[0].model: 'local/' names no model after the provider", "BAD_VALUE"),
    ("provider-without-url", {"models": {"providers": {"acme": {"apiKeyEnv": "ACME_KEY"}}}},
     "models.providers.acme.baseUrl: required key is missing (only the built-in providers have their own)",
     "MISSING_FIELD"),
    ("provider-key-in-file", {"models": {"providers": {"acme": {"baseUrl": "http://127.0.0.1:1/v1",
                                                                 "apiKeyEnv": "sk-live-123"}}}},
     "models.providers.acme.apiKeyEnv: expected the name of an environment variable (the key itself never goes in"
     " the file)", "BAD_VALUE"),
    ("provider-bad-tool-choice", {"models": {"providers": {"local": {"toolChoice": "sometimes"}}}},
     "models.providers.local.toolChoice: must be one of auto, required, got 'sometimes'", "BAD_VALUE"),
    ("provider-unknown-key", {"models": {"providers": {"local": {"url": "http://x"}}}},
     "models.providers.local.url: unknown key; known keys are baseUrl, apiKeyEnv, timeoutSeconds, toolChoice",
     "UNKNOWN_KEY"),
    ("bad-peer-kind", {"bindings": [
        {"agentId": "a", "match": {"channel": "x"}},
        {"agentId": "a", "match": {"channel": "x"}},
        {"agentId": "a", "match": {"channel": "x", "peer": {"kind": "room", "id": "1"}}},
    ]}, "bindings[2].match.peer.kind: must be one of dm, group, channel, got 'room'", "BAD_VALUE"),
    ("roles-without-guild", _binding(roles=["admin"]),
     "bindings[0].match.roles: only allowed together with guildId", "CONFLICTING_FIELDS"),
    ("duplicate-ids", _agents({"id": " Home "}, {"id": "work"}, {"id": "HOME"}),
     "agents.list[2].id: duplicate agent id 'home' (also at agents.list[0].id)", "DUPLICATE_AGENT_ID"),
    ("bad-id-characters", _agents({"id": "bad id!"}),
     "agents.list[0].id: 'bad id!' is not a valid agent id; trimmed and lower-cased it must match "
     "^[a-z0-9][a-z0-9_-]{0,63}$", "BAD_AGENT_ID"),
    ("id-too-long", _agents({"id": "a" * 65}),
     f"agents.list[0].id: {'a' * 65!r} is not a valid agent id; trimmed and lower-cased it must match "
     "^[a-z0-9][a-z0-9_-]{0,63}$", "BAD_AGENT_ID"),
    ("bad-binding-agent-id", {"bindings": [{"agentId": "-lead", "match": {"channel": "x"}}]},
     "bindings[0].agentId: '-lead' is not a valid agent id; trimmed and lower-cased it must match "
     "^[a-z0-9][a-z0-9_-]{0,63}$", "BAD_AGENT_ID"),
    ("bad-allow-agents-entry", _agents({"id": "a", "subagents": {"allowAgents": ["b", "c:d"]}}),
     "agents.list[0].subagents.allowAgents[1]: 'c:d' is not a valid agent id; trimmed and lower-cased it "
     "must match ^[a-z0-9][a-z0-9_-]{0,63}$", "BAD_AGENT_ID"),
    ("missing-id", _agents({"name": "x"}), "agents.list[0].id: required key is missing", "MISSING_FIELD"),
    ("null-id", _agents({"id": None}), "agents.list[0].id: required key is missing", "MISSING_FIELD"),
    ("missing-agent-id", {"bindings": [{"match": {"channel": "x"}}]},
     "bindings[0].agentId: required key is missing", "MISSING_FIELD"),
    ("missing-match", {"bindings": [{"agentId": "a"}]}, "bindings[0].match: required key is missing",
     "MISSING_FIELD"),
    ("missing-channel", {"bindings": [{"agentId": "a", "match": {"accountId": "x"}}]},
     "bindings[0].match.channel: required key is missing", "MISSING_FIELD"),
    ("missing-peer-id", _binding(peer={"kind": "dm"}), "bindings[0].match.peer.id: required key is missing",
     "MISSING_FIELD"),
    ("missing-peer-kind", _binding(peer={"id": "1"}), "bindings[0].match.peer.kind: required key is missing",
     "MISSING_FIELD"),
    ("empty-channel", _binding(channel="  "),
     "bindings[0].match.channel: must not be empty; omit the key instead", "BAD_VALUE"),
    ("unquoted-guild-id", _binding(guildId=123456789),
     "bindings[0].match.guildId: expected a string, got 123456789 (quote it)", "WRONG_TYPE"),
    ("spawn-depth-too-big", {"agents": {"defaults": {"subagents": {"maxSpawnDepth": 11}}}},
     "agents.defaults.subagents.maxSpawnDepth: must be between 1 and 10, got 11", "BAD_VALUE"),
    ("children-bool", _agents({"id": "a", "subagents": {"maxChildrenPerAgent": True}}),
     "agents.list[0].subagents.maxChildrenPerAgent: expected an integer, got True", "WRONG_TYPE"),
    ("children-too-many", _agents({"id": "a", "subagents": {"maxChildrenPerAgent": 101}}),
     "agents.list[0].subagents.maxChildrenPerAgent: must be between 1 and 100, got 101", "BAD_VALUE"),
    ("archive-zero", {"agents": {"defaults": {"subagents": {"archiveAfterMinutes": 0}}}},
     "agents.defaults.subagents.archiveAfterMinutes: must be a finite number greater than 0, got 0",
     "BAD_VALUE"),
    ("loop-visits-zero", {"agents": {"defaults": {"loopGuard": {"maxVisits": 0}}}},
     "agents.defaults.loopGuard.maxVisits: must be at least 1, got 0", "BAD_VALUE"),
    ("budget-string", {"agents": {"defaults": {"loopGuard": {"conversationBudget": "200"}}}},
     "agents.defaults.loopGuard.conversationBudget: expected an integer, got '200'", "WRONG_TYPE"),
    ("bad-dm-scope", {"session": {"dmScope": "per-room"}},
     "session.dmScope: must be one of main, per-peer, per-channel-peer, got 'per-room'", "BAD_VALUE"),
    ("bad-main-key", {"session": {"mainKey": "a:b"}},
     "session.mainKey: 'a:b' must match ^[a-z0-9][a-z0-9_-]{0,63}$ once lower-cased", "BAD_VALUE"),
    ("token-not-string-not-echoed", {"ingress": {"tokens": ["ok", 987654321]}},
     "ingress.tokens[1]: expected a string, got int (quote it)", "WRONG_TYPE"),
    ("token-empty", {"ingress": {"tokens": [" "]}},
     "ingress.tokens[0]: must not be empty; omit the key instead", "BAD_VALUE"),
]


@pytest.mark.parametrize("data, message, reason", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_names_the_key_path(data: object, message: str, reason: str) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        parse_routing_config(data, source="routing.yaml")  # type: ignore[arg-type]
    assert caught.value.message == f"routing.yaml: {message}"
    assert caught.value.reason == reason
    assert caught.value.metadata["field"] == message.split(": ", 1)[0]


@pytest.mark.parametrize(
    "entries, expected_default, expected_warnings",
    [
        ([], "main", ()),
        ([{"id": "a"}, {"id": "b"}], "a", ()),
        ([{"id": "a"}, {"id": "b", "default": True}], "b", ()),
        ([{"id": "a", "default": False}, {"id": "b", "default": True}, {"id": "c", "default": True}], "b",
         ("agents.list: several agents are marked default: true (agents.list[1], agents.list[2]); "
          "using 'b' from agents.list[1]",)),
        ([{"id": " Zed ", "default": True}], "zed", ()),
    ],
    ids=["no-agents-main", "none-marked-first-listed", "marked", "several-marked-first-and-warning",
         "normalized"],
)
def test_default_agent(entries: list, expected_default: str, expected_warnings: tuple) -> None:
    cfg = parse_routing_config(_agents(*entries))
    assert cfg.default_agent_id == expected_default
    assert cfg.warnings == expected_warnings


@pytest.mark.parametrize(
    "raw, expected", [(" Home ", "home"), ("HOME", "home"), ("home", "home"), ("\tOps-2_b\n", "ops-2_b")],
    ids=["spaces", "upper", "already", "tabs-mixed"],
)
def test_agent_ids_are_trimmed_and_lower_cased(raw: str, expected: str) -> None:
    assert normalize_agent_id(raw) == expected
    cfg = parse_routing_config({
        "agents": {"list": [{"id": raw, "subagents": {"allowAgents": [raw.upper()]}}]},
        "bindings": [{"agentId": raw, "match": {"channel": "x"}}],
    })
    assert [agent.id for agent in cfg.agents] == [expected]
    assert cfg.agents[0].subagents.allow_agents == (expected,)
    assert cfg.bindings[0].agent_id == expected
    assert cfg.agent(raw) is cfg.agents[0]
    assert cfg.agent(f"  {expected.upper()} ") is cfg.agents[0]
    assert cfg.warnings == ()


def test_unknown_agents_in_bindings_and_allow_agents_are_warnings() -> None:
    cfg = parse_routing_config({
        "agents": {"list": [{"id": "home", "subagents": {"allowAgents": ["*", "ghost"]}}, {"id": "work"}]},
        "bindings": [
            {"agentId": "work", "match": {"channel": "x"}},
            {"agentId": "Ghost", "match": {"channel": "x"}},
        ],
    })
    assert cfg.bindings[1].agent_id == "ghost"
    assert cfg.warnings == (
        "bindings[1].agentId: agent 'ghost' is not in agents.list; "
        "messages it matches go to the default agent 'home'",
        "agents.list[0].subagents.allowAgents[1]: agent 'ghost' is not in agents.list",
    )


def test_any_binding_agent_is_accepted_without_an_agent_list() -> None:
    cfg = parse_routing_config({"bindings": [{"agentId": "ops", "match": {"channel": "x"}}]})
    assert cfg.warnings == ()
    ops = cfg.agent("OPS")
    assert ops is not None and ops.id == "ops" and ops.default is False
    main = cfg.agent("main")
    assert main is not None and main.default is True
    assert cfg.agent("not valid!") is None


def test_entry_values_override_defaults() -> None:
    cfg = parse_routing_config({
        "agents": {
            "defaults": {
                "model": {"primary": "base", "fallbacks": ["spare"]},
                "workspace": "/ws",
                "skills": ["search"],
                "tools": {"allow": ["list_agents"], "deny": ["close_agent"], "sendTo": "team"},
                "subagents": {"maxSpawnDepth": 3, "maxChildrenPerAgent": 7, "model": "cheap",
                              "allowAgents": ["helper"]},
            },
            "list": [
                {"id": "plain"},
                {"id": "custom", "model": "special", "workspace": "/other", "skills": [],
                 "agentDir": "/state", "tools": {"deny": [], "sendTo": "Any"},
                 "subagents": {"maxSpawnDepth": 1, "allowAgents": ["*"], "model": {"primary": "mid"}}},
                {"id": "helper"},
            ],
        },
    })
    plain, custom, _ = cfg.agents
    assert plain == AgentConfig(
        id="plain",
        workspace="/ws",
        model=ModelConfig("base", ("spare",)),
        skills=("search",),
        subagents=SubagentPolicy(("helper",), ModelConfig("cheap"), 3, 7),
        tools=ToolsPolicy(("list_agents",), ("close_agent",), "team"),
    )
    assert custom == AgentConfig(
        id="custom",
        workspace="/other",
        agent_dir="/state",
        model=ModelConfig("special"),
        skills=(),
        subagents=SubagentPolicy(("*",), ModelConfig("mid"), 1, 7),
        tools=ToolsPolicy(("list_agents",), (), "any"),
    )
    assert cfg.defaults == AgentConfig(
        id="main", workspace="/ws", model=ModelConfig("base", ("spare",)), skills=("search",),
        subagents=SubagentPolicy(("helper",), ModelConfig("cheap"), 3, 7),
        tools=ToolsPolicy(("list_agents",), ("close_agent",), "team"),
    )


def test_yaml_null_counts_as_absent() -> None:
    cfg = parse_routing_config({"agents": None, "bindings": None, "session": {"mainKey": None}})
    assert (cfg.agents, cfg.bindings, cfg.session.main_key) == ((), (), "main")


SPAWN_CONFIG = {
    "agents": {
        "defaults": {"subagents": {"allowAgents": ["helper"]}},
        "list": [
            {"id": "lead", "subagents": {"allowAgents": ["Worker", "reviewer"]}},
            {"id": "boss", "subagents": {"allowAgents": ["*"]}},
            {"id": "worker"},
            {"id": "reviewer", "subagents": {"allowAgents": []}},
            {"id": "helper"},
        ],
    },
}


@pytest.mark.parametrize(
    "requester, target, allowed",
    [
        ("lead", "worker", True),
        ("LEAD", " Worker ", True),
        ("lead", "reviewer", True),
        ("lead", "boss", False),
        ("lead", "lead", True),
        ("reviewer", "reviewer", True),
        ("reviewer", "worker", False),
        ("boss", "anyone", True),
        ("worker", "helper", True),
        ("worker", "lead", False),
        ("stranger", "worker", False),
        ("stranger", "stranger", True),
    ],
    ids=["listed", "normalized", "second-listed", "not-listed", "self", "self-with-empty-list", "empty-list",
         "star", "inherits-defaults", "defaults-do-not-allow", "unknown-requester", "unknown-requester-self"],
)
def test_may_spawn(requester: str, target: str, allowed: bool) -> None:
    assert parse_routing_config(SPAWN_CONFIG).may_spawn(requester, target) is allowed


def test_providers_and_version() -> None:
    """Declared providers with their settings, built-in ones with their defaults, and a version that
    follows the content (not the format): the same data gives the same version, a change another."""
    lab = {"baseUrl": "http://127.0.0.1:8080/v1", "apiKeyEnv": "LAB_KEY", "timeoutSeconds": 240,
           "toolChoice": "required"}
    data: dict[str, Any] = {
        "models": {"providers": {"Lab": lab}},
        "agents": {"list": [{"id": "a", "model": {"primary": "lab/qwen", "fallbacks": ["local/qwen", "gpt-4o"]}}]}}
    cfg = parse_routing_config(data)
    assert cfg.providers == (ProviderConfig("lab", "http://127.0.0.1:8080/v1", "LAB_KEY", 240.0, "required"),)
    assert cfg.provider("lab") == cfg.providers[0]
    assert cfg.provider("local") == ProviderConfig("local") and cfg.provider("acme") is None
    assert cfg.version == parse_routing_config(dict(reversed(list(data.items())))).version
    data["agents"]["list"][0]["model"]["fallbacks"] = ["local/qwen"]
    assert parse_routing_config(data).version != cfg.version


def test_the_tool_names_are_the_hosts_tools() -> None:
    from agent_host.tools import SPECS

    assert set(TOOL_NAMES) == set(SPECS)
