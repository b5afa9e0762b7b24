"""Routing ingress (docs/routing.md): an inbound channel message is routed to
a configured agent by the bindings, and stored in the inbox of that agent's
session (one mesh agent per session key, registered on its first message)
by the ordinary Inbox path. Knows nothing of gRPC."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from inboxmesh.routing.v1 import routing_pb2 as pb
from services import auth
from services.clock import now_us
from services.config import InboxLimits
from services.directory import Directory
from services.routing.config import AgentConfig, PeerMatch, RoutingConfig
from services.routing.resolve import ResolvedRoute, resolve_route
from services.runs.service import AGENT_KEY, ORIGIN_PREFIX
from services.store.base import AGENT_OPEN, CHANNEL_PREFIX, AgentRecord, AgentStore, EventStore, RunStore, SendOutcome
from services.validation import check_map, check_text

log = logging.getLogger(__name__)
PEER_KINDS = {pb.PEER_KIND_DM: "dm", pb.PEER_KIND_GROUP: "group", pb.PEER_KIND_CHANNEL: "channel"}
GATEWAY_KEY = "inboxmesh-channel"
"""Metadata of a channel's gateway agent: `<channel>/<account>` (docs/routing.md "Answers")."""
_CHANNEL_ORIGIN = envelope_pb2.Origin(kind=envelope_pb2.ORIGIN_KIND_CHANNEL)

DeliverFromChannel = Callable[[list[envelope_pb2.Envelope]], Awaitable[list[SendOutcome]]]
"""Stores channel messages by the ordinary inbox path (services.inbox.writer.InboxWriter.deliver_from_channel)."""


def _peer(peer: pb.Peer, field: str) -> PeerMatch | None:
    if not peer.id and not peer.kind:
        return None
    if peer.kind not in PEER_KINDS or not peer.id.strip():
        raise errors.InvalidArgument(f"source.{field} needs a kind (DM, GROUP or CHANNEL) and an id",
                                     reason=Reason.BAD_PEER, metadata={"field": f"source.{field}"})
    check_text(f"source.{field}.id", peer.id, max_len=256)
    return PeerMatch(kind=PEER_KINDS[peer.kind], id=peer.id.strip())


def route_pb(route: ResolvedRoute) -> pb.ResolvedRoute:
    return pb.ResolvedRoute(
        agent_id=route.agent_id, channel=route.channel, account_id=route.account_id, session_key=route.session_key,
        main_session_key=route.main_session_key, matched_by=route.matched_by, binding_index=route.binding_index,
        warning=route.warning, config_version=route.config_version)


class RoutingService:
    def __init__(self, config: RoutingConfig, *, agents: AgentStore, sessions: RunStore, events: EventStore,
                 directory: Directory, deliver: DeliverFromChannel, limits: InboxLimits, admin_token: str | None):
        self._agents = agents
        self._sessions = sessions
        self._events = events
        self._directory = directory
        self._deliver = deliver
        self._limits = limits
        self._admin_token = admin_token
        self.reload_error = ""
        """Why the newest routing file was refused (empty when the config in force is the newest)."""
        self._listeners: list[Callable[[RoutingConfig], None]] = []
        self.use(config)

    def use(self, config: RoutingConfig) -> None:
        """Serve `config` from now on (a validated one: at start, or a reload); whoever listens
        (the run registry's spawn policy) takes it too."""
        self.config = config
        self._tokens = tuple(config.ingress_tokens) + ((self._admin_token,) if self._admin_token else ())
        for warning in config.warnings:
            log.warning("routing config: %s", warning)
        for listener in self._listeners:
            listener(config)

    def on_change(self, listener: Callable[[RoutingConfig], None]) -> None:
        self._listeners.append(listener)

    def check_token(self, token: str | None, action: str) -> None:
        if not self.config.ingress_tokens:
            raise errors.FailedPrecondition(f"{action} is disabled: the routing config has no ingress.tokens",
                                            reason=Reason.NO_INGRESS_TOKENS)
        if not token:
            raise errors.Unauthenticated(f"{action} needs an ingress token: send 'authorization: Bearer <token>'",
                                         reason=Reason.MISSING_CREDENTIAL)
        if not any(auth.secrets_match(token, t) for t in self._tokens):
            raise errors.Unauthenticated(f"{action}: the ingress token is not one of ingress.tokens",
                                         reason=Reason.BAD_CREDENTIAL)

    def resolve(self, source: pb.RouteInput) -> ResolvedRoute:
        if not source.channel.strip():
            raise errors.InvalidArgument("source.channel is required", reason=Reason.MISSING_FIELD,
                                         metadata={"field": "source.channel"})
        for field, value in (("channel", source.channel), ("account_id", source.account_id),
                             ("guild_id", source.guild_id), ("team_id", source.team_id)):
            check_text(f"source.{field}", value, max_len=256)
        return resolve_route(
            self.config, channel=source.channel, account_id=source.account_id or None,
            peer=_peer(source.peer, "peer"), parent_peer=_peer(source.parent_peer, "parent_peer"),
            guild_id=source.guild_id or None, roles=tuple(source.roles), team_id=source.team_id or None)

    async def ingress(self, token: str | None,
                      request: pb.IngressRequest) -> tuple[ResolvedRoute, AgentRecord, bool, SendOutcome]:
        """Returns (route, session agent, whether this created it, receipt)."""
        self.check_token(token, "ingress")
        check_text("message_id", request.message_id, max_len=self._limits.max_id_length, required=True)
        check_text("author", request.author, max_len=256)
        check_map("headers", dict(request.headers))
        route = self.resolve(request.source)
        agent, created = await self._session_agent(route, request.source)
        peer = request.source.peer
        sender = f"{CHANNEL_PREFIX}{route.channel}/{route.account_id}"
        if peer.id:
            sender += f"/{PEER_KINDS[peer.kind]}:{peer.id.strip()}"
        headers = {**request.headers, **self._route_headers(route, request.source)}
        if request.author:
            headers["inboxmesh-route-author"] = request.author
        envelope = envelope_pb2.Envelope(
            message_id=request.message_id, sender=sender, recipient=agent.agent_id,
            kind=envelope_pb2.MESSAGE_KIND_TEXT, content=envelope_pb2.Content(text=request.text),
            conversation_id=route.session_key, origin=_CHANNEL_ORIGIN, headers=headers)
        if envelope.ByteSize() > self._limits.max_message_bytes:
            raise errors.InvalidArgument(f"the message is {envelope.ByteSize()} bytes; the limit is"
                                         f" {self._limits.max_message_bytes}", reason=Reason.MESSAGE_TOO_LARGE)
        [outcome] = await self._deliver([envelope])
        detail = f"{route.matched_by} -> {route.agent_id} session={route.session_key} config={self.config.version}"
        if route.warning:
            detail += f" ({route.warning})"
            log.warning("ingress %s: %s", request.message_id, route.warning)
        await self._events.record_events([ev.Event(
            at_us=now_us(), kind=ev.EVENT_KIND_ROUTED, agent_id=agent.agent_id, message_id=request.message_id,
            sender=sender, recipient=agent.agent_id, sequence=outcome.sequence, detail=detail)])
        log.info("ingress %s from %s routed %s: %s", request.message_id, sender, detail, outcome.status)
        return route, agent, created, outcome

    @staticmethod
    def _route_headers(route: ResolvedRoute, source: pb.RouteInput) -> dict[str, str]:
        headers = {
            "inboxmesh-route-agent": route.agent_id, "inboxmesh-route-session": route.session_key,
            "inboxmesh-route-channel": route.channel, "inboxmesh-route-account": route.account_id,
            "inboxmesh-route-matched-by": route.matched_by,
        }
        if source.peer.id:
            headers["inboxmesh-route-peer"] = f"{PEER_KINDS[source.peer.kind]}:{source.peer.id.strip()}"
        return headers

    async def _session_agent(self, route: ResolvedRoute, source: pb.RouteInput) -> tuple[AgentRecord, bool]:
        agent_id = auth.new_agent_id()
        metadata = {AGENT_KEY: route.agent_id,
                    **{k: v for k, v in self._route_headers(route, source).items() if k.startswith(ORIGIN_PREFIX)}}
        metadata.pop("inboxmesh-route-matched-by")
        record = AgentRecord(
            agent_id=agent_id, name=route.session_key, mode=reg_pb.AGENT_MODE_MAIN, parent_id="", scope_id=agent_id,
            depth=0, state=AGENT_OPEN, metadata=metadata, inbox_capacity=self._limits.default_capacity,
            created_at_us=now_us(),
            # nobody holds this credential: a host takes the session over with ClaimSession
            credential_hash=auth.credential_hash(auth.new_credential(agent_id)))
        agent, created = await self._sessions.session_agent(route.session_key, record)
        self._directory.remember(agent)
        if created:
            log.info("session %s of agent %s registered as %s", route.session_key, route.agent_id, agent.agent_id)
        return agent, created

    async def gateway(self, channel: str, account: str) -> AgentRecord:
        """The gateway agent of a channel account: the inbox of what agents answer on that channel (sends to
        `channel:<channel>/<account>/<kind>:<peer>` are stored there), registered on first use; the
        channel's adapter claims it (ClaimSession with the key `channel:<channel>/<account>`) and reads it
        like any inbox."""
        key = f"{CHANNEL_PREFIX}{channel}/{account}"
        agent_id = auth.new_agent_id()
        record = AgentRecord(
            agent_id=agent_id, name=key, mode=reg_pb.AGENT_MODE_MAIN, parent_id="", scope_id=agent_id, depth=0,
            state=AGENT_OPEN, metadata={GATEWAY_KEY: f"{channel}/{account}"},
            inbox_capacity=self._limits.default_capacity, created_at_us=now_us(),
            credential_hash=auth.credential_hash(auth.new_credential(agent_id)))
        agent, created = await self._sessions.session_agent(key, record)
        self._directory.remember(agent)
        if created:
            log.info("channel gateway %s registered as %s", key, agent.agent_id)
        return agent

    async def claim(self, token: str | None, session_key: str) -> pb.ClaimSessionResponse:
        self.check_token(token, "claiming a session")
        check_text("session_key", session_key, max_len=512, required=True)
        if session_key.startswith(CHANNEL_PREFIX):
            channel, slash, account = session_key.removeprefix(CHANNEL_PREFIX).partition("/")
            if not (channel and slash and account) or "/" in account:
                raise errors.InvalidArgument(f"session_key {session_key!r}: a channel gateway's key is"
                                             " channel:<channel>/<account>", reason=Reason.BAD_SESSION_KEY)
            gateway = await self.gateway(channel, account)
            return await self._claimed(gateway, session_key, "")
        agent_cfg = session_key.split(":")[1] if session_key.startswith("agent:") and session_key.count(":") >= 2 \
            else ""
        if self.config.agent(agent_cfg) is None:
            raise errors.InvalidArgument(f"session_key {session_key!r} does not name a configured agent"
                                         " (agent:<agentId>:...)", reason=Reason.BAD_SESSION_KEY)
        route = ResolvedRoute(agent_id=agent_cfg, channel="", account_id="", session_key=session_key,
                              main_session_key=f"agent:{agent_cfg}:{self.config.session.main_key}",
                              matched_by="claim", binding_index=-1, warning="",
                              config_version=self.config.version)
        agent, _ = await self._session_agent(route, pb.RouteInput())
        return await self._claimed(agent, session_key, agent_cfg)

    async def _claimed(self, agent: AgentRecord, key: str, agent_cfg: str) -> pb.ClaimSessionResponse:
        credential = auth.new_credential(agent.agent_id)
        record = await self._agents.set_credential(agent.agent_id, auth.credential_hash(credential))
        self._directory.credential_changed(record)
        log.info("session %s (%s) claimed; earlier credentials revoked", key, agent.agent_id)
        return pb.ClaimSessionResponse(session_agent_id=agent.agent_id, credential=credential,
                                       agent_config_id=agent_cfg)

    def configured_agents(self) -> pb.ListConfiguredAgentsResponse:
        cfg = self.config
        default = cfg.agent(cfg.default_agent_id)  # with no agents.list: the defaults under the default id
        agents: tuple[AgentConfig, ...] = cfg.agents or ((default,) if default is not None else ())
        return pb.ListConfiguredAgentsResponse(
            default_id=cfg.default_agent_id, main_key=cfg.session.main_key, dm_scope=cfg.session.dm_scope,
            agents=[configured_agent_pb(a, a.id == cfg.default_agent_id) for a in agents],
            reload_error=self.reload_error,
            providers=[pb.ModelProvider(id=p.id, base_url=p.base_url or "", api_key_env=p.api_key_env or "",
                                        timeout_s=p.timeout_s or 0.0, tool_choice=p.tool_choice or "")
                       for p in cfg.providers],
            config_version=cfg.version)


def configured_agent_pb(a: AgentConfig, is_default: bool) -> pb.ConfiguredAgent:
    sub = a.subagents
    return pb.ConfiguredAgent(
        id=a.id, name=a.name or "", is_default=is_default,
        model=a.model.primary if a.model else "", model_fallbacks=list(a.model.fallbacks) if a.model else [],
        identity=pb.Identity(name=a.identity.name or "", emoji=a.identity.emoji or "",
                             avatar=a.identity.avatar or "", avatar_url=a.identity.avatar_url or "",
                             theme=a.identity.theme or ""),
        workspace=a.workspace or "", skills=list(a.skills or ()), all_skills=a.skills is None,
        tools=pb.ToolsPolicy(restricted=a.tools.allow is not None, allow=list(a.tools.allow or ()),
                             deny=list(a.tools.deny), send_to=a.tools.send_to or ""),
        subagents=pb.SubagentPolicy(
            allow_agents=list(sub.allow_agents), model=sub.model.primary if sub.model else "",
            model_fallbacks=list(sub.model.fallbacks) if sub.model else [], max_spawn_depth=sub.max_spawn_depth,
            max_children_per_agent=sub.max_children_per_agent))
