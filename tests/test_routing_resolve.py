"""Route resolution: binding tiers, first match within a tier, the account
pre-filter, thread inheritance, unknown agents, and session keys."""

from typing import Any

import pytest

from inboxmesh.client import errors
from services.routing import PeerMatch, RoutingConfig, binding_tier, parse_routing_config, resolve_route

pytestmark = pytest.mark.store_independent

AGENTS = [{"id": "home", "default": True}, {"id": "work"}, {"id": "code"}, {"id": "ops"}, {"id": "fam"}]


def config(*bindings: dict[str, Any], session: dict[str, str] | None = None) -> RoutingConfig:
    return parse_routing_config({"agents": {"list": AGENTS}, "bindings": list(bindings), "session": session})


def bind(agent: str, channel: str = "discord", **match: Any) -> dict[str, Any]:
    return {"agentId": agent, "match": {"channel": channel, **match}}


def peer(kind: str, peer_id: str) -> dict[str, str]:
    return {"kind": kind, "id": peer_id}


ON_C1 = peer("channel", "C1")
ON_T9 = peer("channel", "T9")
ANY_CHANNEL = peer("channel", "*")
C1 = PeerMatch("channel", "C1")
THREAD = PeerMatch("channel", "T9")

# (id, bindings, message, (agent, matched_by, binding_index))
CASES: list[tuple[str, list[dict[str, Any]], dict[str, Any], tuple[str, str, int]]] = [
    ("no-bindings-default", [], {"peer": C1}, ("home", "default", -1)),
    ("peer", [bind("work", peer=ON_C1)], {"peer": C1}, ("work", "binding.peer", 0)),
    ("peer-kind-must-match", [bind("work", peer=peer("group", "C1"))], {"peer": C1}, ("home", "default", -1)),
    ("peer-id-trimmed", [bind("work", peer=peer("channel", " C1 "))], {"peer": PeerMatch("channel", "C1  ")},
     ("work", "binding.peer", 0)),
    ("peer-id-case-sensitive", [bind("work", peer=ON_C1)], {"peer": PeerMatch("channel", "c1")},
     ("home", "default", -1)),
    ("peer-first-match-wins", [bind("work", peer=ON_C1), bind("code", peer=ON_C1)],
     {"peer": C1}, ("work", "binding.peer", 0)),
    ("peer-binding-needs-a-peer", [bind("work", peer=ON_C1)], {}, ("home", "default", -1)),
    ("parent-thread-inherits", [bind("work", peer=ON_C1)], {"peer": THREAD, "parent_peer": C1},
     ("work", "binding.peer.parent", 0)),
    ("peer-beats-parent", [bind("work", peer=ON_C1), bind("code", peer=ON_T9)],
     {"peer": THREAD, "parent_peer": C1}, ("code", "binding.peer", 1)),
    ("parent-beats-wildcard", [bind("ops", peer=ANY_CHANNEL), bind("work", peer=ON_C1)],
     {"peer": THREAD, "parent_peer": C1}, ("work", "binding.peer.parent", 1)),
    ("wildcard", [bind("ops", peer=peer("group", "*"))], {"peer": PeerMatch("group", "G5")},
     ("ops", "binding.peer.wildcard", 0)),
    ("wildcard-kind-must-match", [bind("ops", peer=peer("group", "*"))], {"peer": PeerMatch("dm", "U1")},
     ("home", "default", -1)),
    ("exact-peer-beats-wildcard-listed-first",
     [bind("ops", peer=peer("group", "*")), bind("work", peer=peer("group", "G5"))],
     {"peer": PeerMatch("group", "G5")}, ("work", "binding.peer", 1)),
    ("wildcard-beats-guild", [bind("code", guildId="g1"), bind("ops", peer=ANY_CHANNEL)],
     {"peer": C1, "guild_id": "g1"}, ("ops", "binding.peer.wildcard", 1)),
    ("peer-beats-guild-listed-first", [bind("code", guildId="g1"), bind("work", peer=ON_C1)],
     {"peer": C1, "guild_id": "g1"}, ("work", "binding.peer", 1)),
    ("peer-binding-other-conditions-must-hold", [bind("work", peer=ON_C1, guildId="g1")],
     {"peer": C1, "guild_id": "g2"}, ("home", "default", -1)),
    ("guild-roles", [bind("ops", guildId="g1", roles=["admin"])],
     {"guild_id": "g1", "roles": ("member", " admin ")}, ("ops", "binding.guild+roles", 0)),
    ("guild-roles-beats-guild-listed-first",
     [bind("code", guildId="g1"), bind("ops", guildId="g1", roles=["admin"])],
     {"guild_id": "g1", "roles": ["admin"]}, ("ops", "binding.guild+roles", 1)),
    ("guild-roles-without-matching-role-falls-to-guild",
     [bind("ops", guildId="g1", roles=["admin"]), bind("code", guildId="g1")],
     {"guild_id": "g1", "roles": ["member"]}, ("code", "binding.guild", 1)),
    ("guild-roles-message-without-roles", [bind("ops", guildId="g1", roles=["admin"])], {"guild_id": "g1"},
     ("home", "default", -1)),
    ("guild-roles-first-match-wins",
     [bind("ops", guildId="g1", roles=["admin"]), bind("work", guildId="g1", roles=["admin", "dev"])],
     {"guild_id": "g1", "roles": ["dev", "admin"]}, ("ops", "binding.guild+roles", 0)),
    ("guild", [bind("code", guildId="g1")], {"guild_id": " g1 "}, ("code", "binding.guild", 0)),
    ("guild-other-guild", [bind("code", guildId="g1")], {"guild_id": "g2"}, ("home", "default", -1)),
    ("guild-first-match-wins", [bind("code", guildId="g1"), bind("work", guildId="g1")], {"guild_id": "g1"},
     ("code", "binding.guild", 0)),
    ("guild-beats-team-listed-first", [bind("work", teamId="t1"), bind("code", guildId="g1")],
     {"guild_id": "g1", "team_id": "t1"}, ("code", "binding.guild", 1)),
    ("team", [bind("work", "slack", teamId="T01")], {"channel": "slack", "team_id": "T01"},
     ("work", "binding.team", 0)),
    ("team-other-team", [bind("work", "slack", teamId="T01")], {"channel": "slack", "team_id": "T02"},
     ("home", "default", -1)),
    ("team-beats-account-listed-first", [bind("fam", "slack"), bind("work", "slack", teamId="T01")],
     {"channel": "slack", "team_id": "T01"}, ("work", "binding.team", 1)),
    ("account-exact", [bind("fam", "telegram", accountId="Personal")],
     {"channel": "telegram", "account_id": " PERSONAL "}, ("fam", "binding.account", 0)),
    ("account-exact-other-account", [bind("fam", "telegram", accountId="personal")],
     {"channel": "telegram", "account_id": "work"}, ("home", "default", -1)),
    ("account-absent-matches-default-account", [bind("fam", "telegram")], {"channel": "telegram"},
     ("fam", "binding.account", 0)),
    ("account-absent-matches-explicit-default", [bind("fam", "telegram")],
     {"channel": "telegram", "account_id": "Default"}, ("fam", "binding.account", 0)),
    ("account-absent-skips-other-accounts", [bind("fam", "telegram")],
     {"channel": "telegram", "account_id": "bot2"}, ("home", "default", -1)),
    ("account-first-match-wins",
     [bind("fam", "telegram", accountId="p"), bind("ops", "telegram", accountId="p")],
     {"channel": "telegram", "account_id": "p"}, ("fam", "binding.account", 0)),
    ("account-tier-skips-peer-bindings", [bind("work", peer=ON_C1)], {"guild_id": "g1"},
     ("home", "default", -1)),
    ("channel-any-account", [bind("ops", "telegram", accountId="*")],
     {"channel": "telegram", "account_id": "anything"}, ("ops", "binding.channel", 0)),
    ("channel-any-account-default", [bind("ops", "telegram", accountId="*")], {"channel": "telegram"},
     ("ops", "binding.channel", 0)),
    ("account-beats-channel-listed-first",
     [bind("ops", "telegram", accountId="*"), bind("fam", "telegram", accountId="p")],
     {"channel": "telegram", "account_id": "p"}, ("fam", "binding.account", 1)),
    ("channel-first-match-wins",
     [bind("ops", "telegram", accountId="*"), bind("fam", "telegram", accountId="*")],
     {"channel": "telegram"}, ("ops", "binding.channel", 0)),
    ("channel-tier-skips-guild-bindings", [bind("code", accountId="*", guildId="g1")], {"guild_id": "g2"},
     ("home", "default", -1)),
    ("other-channel-ignored", [bind("work", "slack", peer=ON_C1)], {"peer": C1},
     ("home", "default", -1)),
    ("channel-normalized", [bind("work", " Discord ", peer=ON_C1)],
     {"channel": " DISCORD ", "peer": C1}, ("work", "binding.peer", 0)),
    ("prefilter-peer-binding-other-account", [bind("work", accountId="bot2", peer=ON_C1)],
     {"peer": C1}, ("home", "default", -1)),
    ("prefilter-peer-binding-same-account", [bind("work", accountId="bot2", peer=ON_C1)],
     {"peer": C1, "account_id": "BOT2"}, ("work", "binding.peer", 0)),
    ("prefilter-peer-binding-any-account", [bind("work", accountId="*", peer=ON_C1)],
     {"peer": C1, "account_id": "bot7"}, ("work", "binding.peer", 0)),
    ("agent-id-normalized", [bind(" WORK ", peer=ON_C1)], {"peer": C1},
     ("work", "binding.peer", 0)),
]


@pytest.mark.parametrize("bindings, message, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_resolve_route(bindings: list[dict[str, Any]], message: dict[str, Any], expected: tuple) -> None:
    message = {"channel": "discord", **message}
    route = resolve_route(config(*bindings), **message)
    assert (route.agent_id, route.matched_by, route.binding_index) == expected
    assert route.warning == ""


@pytest.mark.parametrize(
    "match, tier",
    [
        ({"peer": peer("dm", "u1")}, "binding.peer"),
        ({"peer": peer("dm", "*")}, "binding.peer.wildcard"),
        ({"peer": peer("dm", "u1"), "guildId": "g"}, "binding.peer"),
        ({"guildId": "g", "roles": ["r"]}, "binding.guild+roles"),
        ({"guildId": "g", "roles": []}, "binding.guild"),
        ({"guildId": "g", "teamId": "t"}, "binding.guild"),
        ({"teamId": "t"}, "binding.team"),
        ({"accountId": "a"}, "binding.account"),
        ({}, "binding.account"),
        ({"accountId": "*"}, "binding.channel"),
    ],
    ids=["peer", "wildcard", "peer-with-guild", "guild-roles", "guild-empty-roles", "guild-with-team", "team",
         "account", "no-account", "any-account"],
)
def test_binding_tier(match: dict[str, Any], tier: str) -> None:
    cfg = parse_routing_config({"bindings": [{"agentId": "a", "match": {"channel": "x", **match}}]})
    assert binding_tier(cfg.bindings[0]) == tier


@pytest.mark.parametrize(
    "message, matched_by, index",
    [({"peer": C1}, "binding.peer", 1), ({"account_id": "other"}, "binding.channel", 2)],
    ids=["peer-tier", "channel-tier"],
)
def test_unknown_agent_routes_to_default_with_warning(
    message: dict[str, Any], matched_by: str, index: int
) -> None:
    cfg = config(bind("work", guildId="g1"), bind("Ghost", peer=ON_C1),
                 bind("phantom", accountId="*"))
    route = resolve_route(cfg, channel="discord", **message)
    assert (route.agent_id, route.matched_by, route.binding_index) == ("home", matched_by, index)
    name = "ghost" if index == 1 else "phantom"
    assert route.warning == (
        f"bindings[{index}] names agent {name!r}, which is not in agents.list; "
        "routed to the default agent 'home'"
    )
    assert route.session_key == ("agent:home:discord:channel:c1" if "peer" in message else "agent:home:main")


def test_without_an_agent_list_a_binding_agent_is_used_as_named() -> None:
    cfg = parse_routing_config({"bindings": [{"agentId": "Ops", "match": {"channel": "discord"}}]})
    route = resolve_route(cfg, channel="discord")
    assert (route.agent_id, route.matched_by, route.warning) == ("ops", "binding.account", "")
    assert resolve_route(cfg, channel="slack").agent_id == "main"


@pytest.mark.parametrize(
    "entries, expected",
    [([], "main"), ([{"id": "a"}, {"id": "b"}], "a"), ([{"id": "a"}, {"id": "B", "default": True}], "b")],
    ids=["none-main", "first-listed", "marked"],
)
def test_default_route_uses_default_agent(entries: list[dict[str, Any]], expected: str) -> None:
    route = resolve_route(parse_routing_config({"agents": {"list": entries}}), channel="x")
    assert (route.agent_id, route.matched_by, route.binding_index, route.session_key) == (
        expected, "default", -1, f"agent:{expected}:main"
    )


def test_route_reports_normalized_channel_and_account() -> None:
    route = resolve_route(config(), channel=" Telegram ", account_id=" Bot2 ")
    assert (route.channel, route.account_id) == ("telegram", "bot2")
    assert resolve_route(config(), channel="telegram", account_id="  ").account_id == "default"


SESSION_CASES = [
    ("no-peer", {}, {}, "agent:home:main"),
    ("custom-main-key", {"mainKey": " Desk "}, {}, "agent:home:desk"),
    ("dm-main-scope", {}, {"peer": PeerMatch("dm", "U1")}, "agent:home:main"),
    ("dm-main-scope-custom-key", {"mainKey": "desk", "dmScope": "main"}, {"peer": PeerMatch("dm", "U1")},
     "agent:home:desk"),
    ("dm-per-peer", {"dmScope": "per-peer"}, {"peer": PeerMatch("dm", " U1 ")}, "agent:home:dm:u1"),
    ("dm-per-channel-peer", {"dmScope": "per-channel-peer"}, {"peer": PeerMatch("dm", "U1")},
     "agent:home:telegram:dm:u1"),
    ("group", {}, {"peer": PeerMatch("group", "G-42")}, "agent:home:telegram:group:g-42"),
    ("group-ignores-dm-scope", {"dmScope": "per-peer"}, {"peer": PeerMatch("group", "G-42")},
     "agent:home:telegram:group:g-42"),
    ("channel", {}, {"peer": PeerMatch("Channel", "C1")}, "agent:home:telegram:channel:c1"),
    ("thread", {}, {"peer": PeerMatch("channel", "T9"), "parent_peer": PeerMatch("channel", "C1")},
     "agent:home:telegram:channel:c1:thread:t9"),
    ("thread-under-group", {"dmScope": "per-channel-peer"},
     {"peer": PeerMatch("group", "T9"), "parent_peer": PeerMatch("group", "G1")},
     "agent:home:telegram:group:g1:thread:t9"),
    ("parent-without-peer", {}, {"parent_peer": PeerMatch("channel", "C1")}, "agent:home:main"),
    ("colon-escaped", {}, {"peer": PeerMatch("group", "!Room:matrix.org")},
     "agent:home:telegram:group:!room%3amatrix.org"),
    ("percent-escaped", {"dmScope": "per-peer"}, {"peer": PeerMatch("dm", "50%:x")},
     "agent:home:dm:50%25%3ax"),
]


@pytest.mark.parametrize("session, message, expected", [c[1:] for c in SESSION_CASES],
                         ids=[c[0] for c in SESSION_CASES])
def test_session_keys(session: dict[str, str], message: dict[str, Any], expected: str) -> None:
    cfg = config(session=session)
    route = resolve_route(cfg, channel="Telegram", **message)
    assert route.agent_id == "home"
    assert route.session_key == expected
    assert route.main_session_key == f"agent:home:{cfg.session.main_key}"


def test_session_key_uses_the_routed_agent() -> None:
    cfg = config(bind("work", "slack", peer=ON_C1), session={"mainKey": "desk"})
    route = resolve_route(cfg, channel="slack", peer=C1)
    assert (route.session_key, route.main_session_key) == ("agent:work:slack:channel:c1", "agent:work:desk")


@pytest.mark.parametrize(
    "message, text, reason",
    [
        ({"channel": " "}, "channel: must not be empty", "MISSING_FIELD"),
        ({"channel": "x", "peer": PeerMatch("room", "1")},
         "peer.kind: must be one of dm, group, channel, got 'room'", "BAD_KIND"),
        ({"channel": "x", "parent_peer": PeerMatch("dm", " ")}, "parent_peer.id: must not be empty",
         "MISSING_FIELD"),
        ({"channel": "x", "roles": "admin"}, "roles: expected a sequence of role ids, got the string 'admin'",
         "BAD_ROUTE_INPUT"),
    ],
    ids=["empty-channel", "bad-peer-kind", "empty-parent-id", "roles-string"],
)
def test_bad_route_input(message: dict[str, Any], text: str, reason: str) -> None:
    with pytest.raises(errors.InvalidArgument) as caught:
        resolve_route(config(), **message)
    assert (caught.value.message, caught.value.reason) == (text, reason)
