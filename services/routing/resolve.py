"""Pick the agent for an incoming channel message, and its session key.

Matching. Only bindings whose channel equals the message's channel and whose
accountId fits take part (absent: only the account "default"; "*": any
account; else equal). Each binding belongs to exactly one tier, by the most
specific condition it has; tiers are tried in this order and the first
binding in config order that matches wins:

    binding.peer           peer with an id equal to the message's peer
    binding.peer.parent    the same bindings, matched against the parent peer
                           (a thread inherits its channel's binding)
    binding.peer.wildcard  peer id "*", kind equal to the message peer's kind
    binding.guild+roles    guildId equal and one of the message roles listed
    binding.guild          guildId equal, no roles
    binding.team           teamId equal
    binding.account        no peer, guild or team, and accountId not "*"
    binding.channel        no peer, guild or team, and accountId "*"
    default                the default agent

A binding with neither accountId nor peer/guild/team is in binding.account:
the pre-filter limits it to the account "default", so it names one account
just as `accountId: default` would (OpenClaw's account tier excludes only
"*"). Every condition a binding has must hold, not only the one that sets
its tier: a peer binding that also names a guildId matches only in that
guild. A binding naming an agent missing from agents.list routes to the
default agent, keeps its tier in matched_by and sets ResolvedRoute.warning.

Session keys (all lower-case; ":" and "%" inside channel and peer ids are
written %3a and %25 so that keys stay unambiguous):

    main session            agent:<agentId>:<mainKey>
    no peer                 the main session
    dm, dmScope main        the main session
    dm, per-peer            agent:<agentId>:dm:<peerId>
    dm, per-channel-peer    agent:<agentId>:<channel>:dm:<peerId>
    group or channel peer   agent:<agentId>:<channel>:<kind>:<peerId>
    thread (peer + parent)  agent:<agentId>:<channel>:<parentKind>:<parentId>:thread:<peerId>
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.routing.config import ANY, DEFAULT_ACCOUNT_ID, PEER_KINDS, Binding, PeerMatch, RoutingConfig

TIERS = (
    "binding.peer",
    "binding.peer.parent",
    "binding.peer.wildcard",
    "binding.guild+roles",
    "binding.guild",
    "binding.team",
    "binding.account",
    "binding.channel",
    "default",
)


class PeerLike(Protocol):
    """Anything with a peer kind ("dm", "group", "channel") and id, such as PeerMatch."""

    @property
    def kind(self) -> str: ...

    @property
    def id(self) -> str: ...


@dataclass(frozen=True)
class ResolvedRoute:
    """Where a message goes and which session it belongs to."""

    agent_id: str
    channel: str
    """Normalized (trimmed, lower-case)."""
    account_id: str
    """Normalized; "default" when the message named none."""
    session_key: str
    main_session_key: str
    matched_by: str
    """One of TIERS."""
    binding_index: int
    """Position of the winning binding in config.bindings; -1 for default."""
    warning: str = ""
    """Set when the binding named an unknown agent and the default was used."""
    config_version: str = ""
    """The version of the routing config that decided it (RoutingConfig.version)."""


def binding_tier(binding: Binding) -> str:
    """The tier a binding takes part in (one of TIERS except the parent and default tiers)."""
    match = binding.match
    if match.peer is not None:
        return "binding.peer.wildcard" if match.peer.id == ANY else "binding.peer"
    if match.guild_id is not None:
        return "binding.guild+roles" if match.roles else "binding.guild"
    if match.team_id is not None:
        return "binding.team"
    return "binding.channel" if match.account_id == ANY else "binding.account"


def resolve_route(
    cfg: RoutingConfig,
    *,
    channel: str,
    account_id: str | None = None,
    peer: PeerLike | None = None,
    parent_peer: PeerLike | None = None,
    guild_id: str | None = None,
    roles: Iterable[str] = (),
    team_id: str | None = None,
) -> ResolvedRoute:
    """Route one incoming message; raises InvalidArgument for malformed input."""
    channel = _channel(channel)
    account = (account_id or "").strip().lower() or DEFAULT_ACCOUNT_ID
    msg_peer = _peer(peer, "peer")
    parent = _peer(parent_peer, "parent_peer")
    guild = (guild_id or "").strip() or None
    team = (team_id or "").strip() or None
    if isinstance(roles, str):
        raise errors.InvalidArgument(
            f"roles: expected a sequence of role ids, got the string {roles!r}",
            reason=Reason.BAD_ROUTE_INPUT,
            metadata={"field": "roles"},
        )
    role_set = frozenset(role.strip() for role in roles if role.strip())

    def conditions_hold(binding: Binding, peer_seen: PeerMatch | None) -> bool:
        match = binding.match
        if match.peer is not None:
            if peer_seen is None or match.peer.kind != peer_seen.kind:
                return False
            if match.peer.id != ANY and match.peer.id != peer_seen.id:
                return False
        if match.guild_id is not None and match.guild_id != guild:
            return False
        if match.roles and not role_set.intersection(match.roles):
            return False
        return match.team_id is None or match.team_id == team

    tiers: tuple[tuple[str, str, PeerMatch | None], ...] = (
        # (matched_by, tier of the bindings tried, peer the bindings are matched against)
        ("binding.peer", "binding.peer", msg_peer),
        ("binding.peer.parent", "binding.peer", parent),
        ("binding.peer.wildcard", "binding.peer.wildcard", msg_peer),
        ("binding.guild+roles", "binding.guild+roles", msg_peer),
        ("binding.guild", "binding.guild", msg_peer),
        ("binding.team", "binding.team", msg_peer),
        ("binding.account", "binding.account", msg_peer),
        ("binding.channel", "binding.channel", msg_peer),
    )
    candidates = [
        binding for binding in cfg.bindings
        if binding.match.channel == channel and _account_fits(binding.match.account_id, account)
    ]
    for matched_by, tier, peer_seen in tiers:
        if matched_by == "binding.peer.parent" and parent is None:
            continue
        found = next((b for b in candidates if binding_tier(b) == tier and conditions_hold(b, peer_seen)), None)
        if found is not None:
            return _route(cfg, found, matched_by, channel, account, msg_peer, parent)
    return _route(cfg, None, "default", channel, account, msg_peer, parent)


def main_session_key(agent_id: str, main_key: str) -> str:
    """The agent's main session: agent:<agentId>:<mainKey>."""
    return f"agent:{agent_id}:{main_key}"


def session_key(
    cfg: RoutingConfig, agent_id: str, channel: str, peer: PeerMatch | None, parent: PeerMatch | None
) -> str:
    """The session a message with these (normalized) peers belongs to; see the module docstring."""
    main = main_session_key(agent_id, cfg.session.main_key)
    if peer is None:
        return main
    peer_id = _key_part(peer.id)
    if parent is not None:
        return f"agent:{agent_id}:{_key_part(channel)}:{parent.kind}:{_key_part(parent.id)}:thread:{peer_id}"
    if peer.kind != "dm":
        return f"agent:{agent_id}:{_key_part(channel)}:{peer.kind}:{peer_id}"
    if cfg.session.dm_scope == "per-peer":
        return f"agent:{agent_id}:dm:{peer_id}"
    if cfg.session.dm_scope == "per-channel-peer":
        return f"agent:{agent_id}:{_key_part(channel)}:dm:{peer_id}"
    return main


def _route(
    cfg: RoutingConfig,
    binding: Binding | None,
    matched_by: str,
    channel: str,
    account: str,
    peer: PeerMatch | None,
    parent: PeerMatch | None,
) -> ResolvedRoute:
    agent_id, index, warning = cfg.default_agent_id, -1, ""
    if binding is not None:
        index = binding.index
        if cfg.agent(binding.agent_id) is not None:
            agent_id = binding.agent_id
        else:
            warning = (
                f"bindings[{index}] names agent {binding.agent_id!r}, which is not in agents.list; "
                f"routed to the default agent {agent_id!r}"
            )
    return ResolvedRoute(
        agent_id=agent_id,
        channel=channel,
        account_id=account,
        session_key=session_key(cfg, agent_id, channel, peer, parent),
        main_session_key=main_session_key(agent_id, cfg.session.main_key),
        matched_by=matched_by,
        binding_index=index,
        warning=warning,
        config_version=cfg.version,
    )


def _account_fits(binding_account: str | None, account: str) -> bool:
    if binding_account is None:
        return account == DEFAULT_ACCOUNT_ID
    return binding_account == ANY or binding_account == account


def _channel(value: str) -> str:
    channel = (value or "").strip().lower()
    if not channel:
        raise errors.InvalidArgument("channel: must not be empty", reason=Reason.MISSING_FIELD,
                                     metadata={"field": "channel"})
    return channel


def _peer(value: PeerLike | None, name: str) -> PeerMatch | None:
    """The peer with kind checked and lower-cased and id trimmed."""
    if value is None:
        return None
    kind = str(value.kind).strip().lower()
    if kind not in PEER_KINDS:
        raise errors.InvalidArgument(
            f"{name}.kind: must be one of {', '.join(PEER_KINDS)}, got {value.kind!r}",
            reason=Reason.BAD_KIND,
            metadata={"field": f"{name}.kind"},
        )
    peer_id = str(value.id).strip()
    if not peer_id:
        raise errors.InvalidArgument(f"{name}.id: must not be empty", reason=Reason.MISSING_FIELD,
                                     metadata={"field": f"{name}.id"})
    return PeerMatch(kind, peer_id)


def _key_part(value: str) -> str:
    return value.lower().replace("%", "%25").replace(":", "%3a")
