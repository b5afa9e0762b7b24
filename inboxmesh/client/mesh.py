"""A Python client for the mesh: typed calls with deadlines, declared
retries for idempotent calls, calls that wait within their deadline for a
mesh that is restarting, trace context on every message, and failures
turned back into MeshError subclasses."""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import grpc
from opentelemetry import trace

from inboxmesh.client import credentials, errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.sending import SendStream
from inboxmesh.client.status import error_info, from_error_fields, from_rpc_error
from inboxmesh.client.tracing import inject, tracer
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev_pb
from inboxmesh.events.v1 import events_pb2_grpc
from inboxmesh.gateway.v1 import gateway_pb2 as gw_pb
from inboxmesh.gateway.v1 import gateway_pb2_grpc
from inboxmesh.inbox.v1 import inbox_pb2 as inbox_pb
from inboxmesh.inbox.v1 import inbox_pb2_grpc
from inboxmesh.ioa.v1 import relay_pb2 as relay_pb
from inboxmesh.ioa.v1 import relay_pb2_grpc
from inboxmesh.registry.v1 import registry_pb2 as reg_pb
from inboxmesh.registry.v1 import registry_pb2_grpc
from inboxmesh.routing.v1 import routing_pb2 as route_pb
from inboxmesh.routing.v1 import routing_pb2_grpc
from inboxmesh.runs.v1 import runs_pb2 as runs_pb
from inboxmesh.runs.v1 import runs_pb2_grpc

_IDEMPOTENT = {
    "inboxmesh.inbox.v1.InboxService": ["Send", "Ack", "GetMessageStatus", "ListDeadLetters"],
    # RegisterAgent, RegisterChildren: this client always sends request_ids, which make a retry name the same
    # agents
    "inboxmesh.registry.v1.RegistryService": ["RegisterAgent", "RegisterChildren", "GetAgent", "ResolveAgent",
                                              "ListAgents", "CloseAgent"],
    "inboxmesh.events.v1.EventService": ["ListEvents"],
    "inboxmesh.runs.v1.SubagentRunService": ["EndRun", "GetRun", "ListRuns"],
    "inboxmesh.ioa.v1.IoaRelayService": ["RelayStatus", "MapAddress", "SpaceRead"],
}
RETRY_POLICY = {
    "maxAttempts": 5,
    "initialBackoff": "0.05s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def unary_methods() -> list[tuple[str, str]]:
    """(service, method) of every unary RPC of the services this client calls."""
    return [(service.full_name, method.name)
            for module in (reg_pb, inbox_pb, ev_pb, runs_pb, route_pb, relay_pb)
            for service in module.DESCRIPTOR.services_by_name.values()
            for method in service.methods if not (method.client_streaming or method.server_streaming)]


def service_config(*, wait_for_ready: bool = True) -> str:
    """The channel's declared call policy: retries on UNAVAILABLE for the
    idempotent calls, and (by default) wait-for-ready for every unary call.

    Wait-for-ready holds a call, within its deadline, until the channel has
    a connection instead of failing it at once while the mesh is away (a
    restart). It only delays the moment the request is first sent, so it
    cannot duplicate anything, idempotent or not; every unary call this
    client makes carries a deadline. Streams (Subscribe, Consume,
    SendStream, WatchEvents) have no deadline and keep failing fast: their
    owners resubscribe with their own backoff."""
    def names(methods: list[tuple[str, str]]) -> list[dict[str, str]]:
        return [{"service": s, "method": m} for s, m in methods]

    idempotent = [(s, m) for s, methods in _IDEMPOTENT.items() for m in methods]
    ready = {"waitForReady": True} if wait_for_ready else {}
    configs = [{"name": names(idempotent), "retryPolicy": RETRY_POLICY, **ready}]
    others = [method for method in unary_methods() if method not in idempotent]
    if ready and others:  # a method may be named in one entry only
        configs.append({"name": names(others), **ready})
    return json.dumps({"methodConfig": configs})


SERVICE_CONFIG = service_config()
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def channel_options(*, wait_for_ready: bool = True) -> list[tuple[str, object]]:
    return [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(wait_for_ready=wait_for_ready)),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Reconnecting after the mesh went away. gRPC's defaults (first retry
        # after 1 s, x1.6 per failure, up to 120 s) leave a client that saw a
        # few refused connections during a restart unable to reach the mesh
        # for seconds to minutes after it is back. Here the delay between
        # attempts starts at 100 ms (gRPC's floor) and stops growing at 1 s,
        # so a client connects within about 1.2 s (20% jitter) of the mesh
        # being back, at the cost of about one connection attempt per second
        # per client while it is away.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        # Despite its name, the least time one connection attempt (TCP and
        # HTTP/2 handshake) is given before it is abandoned (default 20 s).
        # 5 s is ample for a mesh that is busy starting up on a loaded
        # machine, and bounds how long an attempt whose packets are dropped
        # (a host that vanished) holds up the next one.
        ("grpc.min_reconnect_backoff_ms", 5_000),
    ]


def new_message_id() -> str:
    return uuid.uuid4().hex


def envelope(
    recipient: str,
    text: str = "",
    *,
    message_id: str | None = None,
    kind: int = env_pb.MESSAGE_KIND_TEXT,
    in_reply_to: str = "",
    conversation_id: str = "",
    data: bytes = b"",
    media_type: str = "",
    headers: dict[str, str] | None = None,
    hop_count: int = 0,
    expires_at_us: int = 0,
    trail: Iterable[str] = (),
) -> env_pb.Envelope:
    return env_pb.Envelope(
        message_id=message_id or new_message_id(),
        recipient=recipient,
        # the generated stub takes only MessageKind members; proto3 enums are open and any int is sent as it is
        kind=kind,  # type: ignore[arg-type]
        content=env_pb.Content(text=text, data=data, media_type=media_type),
        in_reply_to=in_reply_to,
        conversation_id=conversation_id,
        headers=headers or {},
        hop_count=hop_count,
        expires_at_us=expires_at_us,
        trail=list(trail),
    )


def _request_id() -> str:
    return secrets.token_hex(16)


def tls_credentials(ca: str | Path | None = None, cert: str | Path | None = None,
                    key: str | Path | None = None) -> grpc.ChannelCredentials:
    """TLS for MeshClient: trust the CA in the PEM file `ca` (the system's roots when None); with `cert` and
    `key` (PEM files) present that client certificate to a mesh that requires one (mutual TLS)."""
    def read(path: str | Path | None) -> bytes | None:
        return Path(path).read_bytes() if path is not None else None

    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))


class MeshClient:
    """Connection to a mesh. `async with MeshClient("127.0.0.1:7400") as mesh:`."""

    def __init__(self, target: str, *, timeout: float = 10.0, admin_token: str | None = None,
                 wait_for_ready: bool = True, tls: grpc.ChannelCredentials | None = None):
        """`timeout` is the deadline of each unary call, in seconds. With
        `wait_for_ready` (the default) a call made while there is no
        connection to the mesh (it is restarting) waits for one within its
        deadline; False makes such calls fail at once with UNAVAILABLE (for
        a caller that would rather try another mesh). `tls`: connect with TLS
        (`tls_credentials(...)`, or grpc.ssl_channel_credentials); plaintext
        without."""
        self.target = target
        self.timeout = timeout
        self.admin_token = admin_token
        options = channel_options(wait_for_ready=wait_for_ready)
        self.channel = (grpc.aio.secure_channel(target, tls, options=options) if tls is not None else
                        grpc.aio.insecure_channel(target, options=options))
        self.registry = registry_pb2_grpc.RegistryServiceStub(self.channel)
        self.inbox = inbox_pb2_grpc.InboxServiceStub(self.channel)
        self.events = events_pb2_grpc.EventServiceStub(self.channel)
        self.runs = runs_pb2_grpc.SubagentRunServiceStub(self.channel)
        self.routing = routing_pb2_grpc.RoutingServiceStub(self.channel)
        self.relay = relay_pb2_grpc.IoaRelayServiceStub(self.channel)
        self.gateway = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _call(self, awaitable):
        try:
            return await awaitable
        except grpc.aio.AioRpcError as exc:
            if (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and error_info(exc) is None
                    and self.channel.get_state() != grpc.ChannelConnectivity.READY):
                # a wait-for-ready call whose deadline passed before there was a connection
                raise errors.DeadlineExceeded(
                    f"no connection to the mesh at {self.target} within the call's deadline (is it running?):"
                    f" {exc.details()}", reason=Reason.MESH_UNREACHABLE) from None
            raise from_rpc_error(exc) from None

    def _admin_metadata(self):
        return credentials.metadata_for(self.admin_token) if self.admin_token else None

    async def register(
        self,
        name: str,
        *,
        metadata: dict[str, str] | None = None,
        inbox_capacity: int = 0,
        request_id: str = "",
    ) -> AgentHandle:
        """Register a top-level agent (retried on UNAVAILABLE with the same
        request_id, a fresh random one unless given)."""
        response = await self._call(
            self.registry.RegisterAgent(
                reg_pb.RegisterAgentRequest(name=name, mode=reg_pb.AGENT_MODE_MAIN, metadata=metadata or {},
                                            inbox_capacity=inbox_capacity, request_id=request_id or _request_id()),
                timeout=self.timeout,
                metadata=self._admin_metadata(),
            )
        )
        return AgentHandle(self, response.agent, response.credential)

    def agent(self, agent: reg_pb.Agent | str, credential: str) -> AgentHandle:
        if isinstance(agent, str):
            agent = reg_pb.Agent(agent_id=agent)
        return AgentHandle(self, agent, credential)

    def send_stream(self, owner: AgentHandle | None = None, *, max_in_flight: int = 256,
                    max_batch: int = 256) -> SendStream:
        """One pipelined SendStream for the sends of many agents of a host: `await stream.send(agent,
        envelopes)` as any agent (its credential rides with its first send on the stream); sends made while
        a request is being written are coalesced into the next one (at most max_batch messages). The call
        is authenticated by `owner`'s credential, or by the admin token when there is no owner. See
        inboxmesh.client.sending."""
        return SendStream(self, owner=owner, max_in_flight=max_in_flight, max_batch=max_batch)

    # -- operator calls (admin token) --------------------------------------
    async def admin_events(
        self, *, message_id: str = "", sender: str = "", agent_id: str = "", kinds: Iterable[ev_pb.EventKind] = (),
        after: int = 0, limit: int = 1000,
    ) -> list[ev_pb.Event]:
        request = ev_pb.ListEventsRequest(
            filter=ev_pb.EventFilter(message_id=message_id, sender=sender, agent_id=agent_id, kinds=list(kinds)),
            after_event_id=after, limit=limit,
        )
        response = await self._call(self.events.ListEvents(request, timeout=self.timeout,
                                                           metadata=self._admin_metadata()))
        return list(response.events)

    async def admin_agent(self, agent_id: str) -> reg_pb.Agent:
        """Any agent by id (admin token)."""
        response = await self._call(self.registry.GetAgent(reg_pb.GetAgentRequest(agent_id=agent_id),
                                                           timeout=self.timeout, metadata=self._admin_metadata()))
        return response.agent

    async def admin_watch_events(self, *, kinds: Iterable[ev_pb.EventKind] = (), after: int = 0,
                                 from_now: bool = False, agent_id: str = "") -> AsyncIterator[ev_pb.Event]:
        """Follow the whole event record live (admin token): events after `after` first, then new ones
        (only those about `agent_id` when given)."""
        request = ev_pb.WatchEventsRequest(filter=ev_pb.EventFilter(kinds=list(kinds), agent_id=agent_id),
                                           after_event_id=after, from_now=from_now)
        async for event in _watch(self, request, self._admin_metadata()):
            yield event

    async def sweep_runs(self) -> runs_pb.SweepRunsResponse:
        """Run the subagent-run sweeper now (admin token)."""
        return await self._call(self.runs.SweepRuns(runs_pb.SweepRunsRequest(), timeout=self.timeout,
                                               metadata=self._admin_metadata()))

    async def admin_run(self, *, run_id: str = "", child_id: str = "") -> runs_pb.SubagentRun:
        return await self._call(self.runs.GetRun(runs_pb.GetRunRequest(run_id=run_id, child_id=child_id),
                                            timeout=self.timeout, metadata=self._admin_metadata()))

    async def claim_gateway(self, family: str = "a2a") -> AgentHandle:
        """The gateway agent of an address family, with a new credential (admin token): docs/interop.md."""
        response = await self._call(self.gateway.ClaimGateway(gw_pb.ClaimGatewayRequest(family=family),
                                                              timeout=self.timeout, metadata=self._admin_metadata()))
        return AgentHandle(self, response.agent, response.credential)

    # -- routing (ingress token) -------------------------------------------
    async def ingress(self, token: str, source: route_pb.RouteInput, message_id: str, text: str,
                      **fields) -> route_pb.IngressResponse:
        request = route_pb.IngressRequest(source=source, message_id=message_id, text=text, **fields)
        return await self._call(self.routing.Ingress(request, timeout=self.timeout,
                                                     metadata=credentials.metadata_for(token)))

    async def resolve_route(self, source: route_pb.RouteInput) -> route_pb.ResolvedRoute:
        return await self._call(self.routing.ResolveRoute(route_pb.ResolveRouteRequest(source=source),
                                                     timeout=self.timeout))

    async def configured_agents(self) -> route_pb.ListConfiguredAgentsResponse:
        return await self._call(self.routing.ListConfiguredAgents(route_pb.ListConfiguredAgentsRequest(),
                                                             timeout=self.timeout))

    async def claim_session(self, token: str, session_key: str) -> AgentHandle:
        response = await self._call(self.routing.ClaimSession(route_pb.ClaimSessionRequest(session_key=session_key),
                                                              timeout=self.timeout,
                                                              metadata=credentials.metadata_for(token)))
        return self.agent(response.session_agent_id, response.credential)


class AgentHandle:
    """Calls made as one agent (with its credential)."""

    def __init__(self, client: MeshClient, agent: reg_pb.Agent, credential: str, run_id: str = ""):
        self.client = client
        self.info = agent
        self.credential = credential
        self.metadata = credentials.metadata_for(credential)
        self.run_id = run_id
        """The run this agent was spawned for (children)."""

    @property
    def agent_id(self) -> str:
        return self.info.agent_id

    def __repr__(self) -> str:
        return f"AgentHandle({self.info.name or '?'}:{self.agent_id})"

    def _opts(self, timeout: float | None = None) -> dict:
        return {"timeout": timeout or self.client.timeout, "metadata": self.metadata}

    # -- registry -----------------------------------------------------------
    async def spawn(
        self, name: str, mode: int = reg_pb.AGENT_MODE_ASYNC, *, metadata: dict[str, str] | None = None,
        inbox_capacity: int = 0, run: reg_pb.RunSpec | None = None, request_id: str = "",
    ) -> AgentHandle:
        """Register a child of this agent (and its run); retried like register."""
        response = await self.client._call(
            self.client.registry.RegisterAgent(
                # mode: the generated stub takes only AgentMode members (see envelope())
                reg_pb.RegisterAgentRequest(name=name, mode=mode,  # type: ignore[arg-type]
                                            parent_id=self.agent_id, metadata=metadata or {},
                                            inbox_capacity=inbox_capacity, run=run,
                                            request_id=request_id or _request_id()),
                **self._opts(),
            )
        )
        return AgentHandle(self.client, response.agent, response.credential, response.run_id)

    async def spawn_many(self, children: list[reg_pb.RegisterAgentRequest]) -> list[AgentHandle | errors.MeshError]:
        """Register many children of this agent in one RegisterChildren call (at most 1,000; the mesh stores
        them together), in order: per entry its handle, or the MeshError that refused that entry alone.
        An entry without a request_id gets a fresh random one, so the call is retried like `spawn`."""
        entries = []
        for child in children:
            entry = reg_pb.RegisterAgentRequest()
            entry.CopyFrom(child)
            entry.request_id = entry.request_id or _request_id()
            entries.append(entry)
        response = await self.client._call(self.client.registry.RegisterChildren(
            reg_pb.RegisterChildrenRequest(children=entries), **self._opts()))
        return [AgentHandle(self.client, r.registered.agent, r.registered.credential, r.registered.run_id)
                if r.HasField("registered") else
                from_error_fields(r.error.code, r.error.reason, r.error.message, dict(r.error.metadata))
                for r in response.results]

    async def end_run(self, result: str, *, failed: bool = False, run_id: str = "") -> runs_pb.EndRunResponse:
        """End this agent's run (or, as an ancestor, the run `run_id`)."""
        return await self.client._call(self.client.runs.EndRun(
            runs_pb.EndRunRequest(run_id=run_id, failed=failed, result=result), **self._opts()))

    async def get_run(self, *, run_id: str = "", child_id: str = "") -> runs_pb.SubagentRun:
        if not run_id and not child_id:
            child_id = self.agent_id
        return await self.client._call(self.client.runs.GetRun(
            runs_pb.GetRunRequest(run_id=run_id, child_id=child_id), **self._opts()))

    async def list_runs(self, *, requester_id: str = "", include_archived: bool = False) -> list[runs_pb.SubagentRun]:
        runs, token = [], ""
        while True:
            response = await self.client._call(self.client.runs.ListRuns(runs_pb.ListRunsRequest(
                requester_id=requester_id, include_archived=include_archived, page_token=token), **self._opts()))
            runs += response.runs
            token = response.next_page_token
            if not token:
                return runs

    async def get(self, agent_id: str | None = None) -> reg_pb.Agent:
        response = await self.client._call(
            self.client.registry.GetAgent(reg_pb.GetAgentRequest(agent_id=agent_id or self.agent_id), **self._opts())
        )
        return response.agent

    async def resolve(self, name: str, *, scope_id: str = "", include_closed: bool = False) -> reg_pb.Agent:
        response = await self.client._call(
            self.client.registry.ResolveAgent(
                reg_pb.ResolveAgentRequest(name=name, scope_id=scope_id, include_closed=include_closed),
                **self._opts(),
            )
        )
        return response.agent

    async def list_agents(
        self, *, scope_id: str = "", parent_id: str = "", include_closed: bool = False
    ) -> list[reg_pb.Agent]:
        agents, token = [], ""
        while True:
            response = await self.client._call(
                self.client.registry.ListAgents(
                    reg_pb.ListAgentsRequest(scope_id=scope_id, parent_id=parent_id, include_closed=include_closed,
                                             page_size=1000, page_token=token),
                    **self._opts(),
                )
            )
            agents += response.agents
            token = response.next_page_token
            if not token:
                return agents

    async def close(self, agent_id: str | None = None, reason: str = "") -> reg_pb.CloseAgentResponse:
        return await self.client._call(
            self.client.registry.CloseAgent(
                reg_pb.CloseAgentRequest(agent_id=agent_id or self.agent_id, reason=reason), **self._opts()
            )
        )

    # -- inbox --------------------------------------------------------------
    def _traced(self, envelopes: Iterable[env_pb.Envelope]) -> list:
        spans = []
        for e in envelopes:
            span = tracer.start_span("send", kind=trace.SpanKind.PRODUCER, attributes={
                "messaging.system": "inboxmesh", "messaging.message.id": e.message_id,
                "inboxmesh.sender": self.agent_id, "inboxmesh.recipient": e.recipient})
            if span.get_span_context().is_valid:
                inject(e, trace.set_span_in_context(span))
            spans.append(span)
        return spans

    async def send_batch(self, envelopes: list[env_pb.Envelope], timeout: float | None = None,
                         ioa_delivery: inbox_pb.IoaDelivery = inbox_pb.IOA_DELIVERY_DEFAULT
                         ) -> list[inbox_pb.Receipt]:
        """Send the messages in one request; their receipts. `ioa_delivery`: what a message to an IOA agent
        whose node cannot be reached does (inbox_pb.IOA_DELIVERY_OUTBOX: kept in the mesh's outbox,
        receipt OUTBOXED; _DIRECT: UNAVAILABLE; _DEFAULT: as the mesh is configured)."""
        spans = self._traced(envelopes)
        try:
            request = inbox_pb.SendRequest(messages=envelopes, ioa_delivery=ioa_delivery)
            response = await self.client._call(self.client.inbox.Send(request, **self._opts(timeout)))
        finally:
            for span in spans:
                span.end()
        return list(response.receipts)

    async def send(self, recipient: str, text: str = "", *,
                   ioa_delivery: inbox_pb.IoaDelivery = inbox_pb.IOA_DELIVERY_DEFAULT,
                   **fields) -> inbox_pb.Receipt:
        """Send one message; returns its receipt (ACCEPTED, INBOX_FULL, ...; `ioa_delivery` as for
        send_batch)."""
        return (await self.send_batch([envelope(recipient, text, **fields)], ioa_delivery=ioa_delivery))[0]

    async def reply(self, to: env_pb.Envelope, text: str = "", **fields) -> inbox_pb.Receipt:
        fields.setdefault("conversation_id", to.conversation_id)
        return await self.send(to.sender, text, kind=env_pb.MESSAGE_KIND_REPLY, in_reply_to=to.message_id, **fields)

    def send_stream(self):
        """A SendStream call as this agent (one response per request, in order)."""
        return self.client.inbox.SendStream(metadata=self.metadata)

    def subscribe(self, max_in_flight: int = 0, extra: Iterable[AgentHandle] = ()):
        """The raw Subscribe call for this agent (and `extra` agents)."""
        credentials = [self.credential, *(a.credential for a in extra)]
        return self.client.inbox.Subscribe(
            inbox_pb.SubscribeRequest(credentials=credentials, max_in_flight=max_in_flight)
        )

    async def ack(self, sequences: Iterable[int]) -> list[inbox_pb.AckResult]:
        response = await self.client._call(
            self.client.inbox.Ack(inbox_pb.AckRequest(agent_id=self.agent_id, sequences=list(sequences)),
                                  **self._opts())
        )
        return list(response.results)

    async def status(self, message_id: str, *, sender: str = "") -> inbox_pb.MessageStatus:
        key = inbox_pb.MessageKey(by_sender=inbox_pb.SenderKey(sender=sender, message_id=message_id))
        response = await self.client._call(
            self.client.inbox.GetMessageStatus(inbox_pb.GetMessageStatusRequest(key=key), **self._opts())
        )
        return response.status

    async def inbox_status(self, sequence: int, *, recipient: str = "") -> inbox_pb.MessageStatus:
        key = inbox_pb.MessageKey(by_inbox=inbox_pb.InboxKey(recipient=recipient, sequence=sequence))
        response = await self.client._call(
            self.client.inbox.GetMessageStatus(inbox_pb.GetMessageStatusRequest(key=key), **self._opts())
        )
        return response.status

    async def dead_letters(self, *, recipient: str = "", sender: str = "") -> list[inbox_pb.MessageStatus]:
        found, token = [], ""
        while True:
            response = await self.client._call(
                self.client.inbox.ListDeadLetters(
                    inbox_pb.ListDeadLettersRequest(recipient=recipient, sender=sender, page_size=1000,
                                                    page_token=token),
                    **self._opts(),
                )
            )
            found += response.messages
            token = response.next_page_token
            if not token:
                return found

    async def deliver(self, envelopes: list[env_pb.Envelope], timeout: float | None = None) -> list[inbox_pb.Receipt]:
        """As a gateway agent (MeshClient.claim_gateway): store messages from outside addresses."""
        spans = self._traced(envelopes)
        try:
            response = await self.client._call(self.client.gateway.Deliver(
                gw_pb.DeliverRequest(messages=envelopes), **self._opts(timeout)))
        finally:
            for span in spans:
                span.end()
        return list(response.receipts)

    # -- events -------------------------------------------------------------
    async def events(
        self, *, message_id: str = "", sender: str = "", agent_id: str = "", kinds: Iterable[ev_pb.EventKind] = (),
        after: int = 0, limit: int = 1000,
    ) -> list[ev_pb.Event]:
        request = ev_pb.ListEventsRequest(
            filter=ev_pb.EventFilter(message_id=message_id, sender=sender, agent_id=agent_id, kinds=list(kinds)),
            after_event_id=after, limit=limit,
        )
        response = await self.client._call(self.client.events.ListEvents(request, **self._opts()))
        return list(response.events)

    async def record_events(self, events: list[ev_pb.Event], timeout: float | None = None) -> None:
        """Record runtime events about this agent (turns, wakes, spawns: docs/lifecycle.md) in the mesh's
        event record."""
        await self.client._call(self.client.events.RecordEvents(ev_pb.RecordEventsRequest(events=events),
                                                                **self._opts(timeout)))

    async def watch_events(
        self, *, agent_id: str = "", sender: str = "", message_id: str = "", kinds: Iterable[ev_pb.EventKind] = (),
        from_now: bool = False, after: int = 0,
    ) -> AsyncIterator[ev_pb.Event]:
        request = ev_pb.WatchEventsRequest(
            filter=ev_pb.EventFilter(agent_id=agent_id, sender=sender, message_id=message_id, kinds=list(kinds)),
            after_event_id=after, from_now=from_now)
        async for event in _watch(self.client, request, self.metadata):
            yield event

    # -- IOA relay (a mesh without one answers UNIMPLEMENTED: MeshError with reason "UNIMPLEMENTED") -----
    async def map_address(self, agent_id: str) -> str:
        """The IOA address ("ioa:<node>/<agent>") of a local agent of this mesh."""
        response = await self.client._call(
            self.client.relay.MapAddress(relay_pb.MapAddressRequest(agent_id=agent_id), **self._opts()))
        return response.address

    async def space_send(self, space: str, text: str) -> relay_pb.SpaceSendResponse:
        """Post in a shared IOA space as this agent (joining it when needed)."""
        return await self.client._call(
            self.client.relay.SpaceSend(relay_pb.SpaceSendRequest(space=space, text=text), **self._opts()))

    async def space_read(self, space: str, after: int = 0) -> relay_pb.SpaceReadResponse:
        """A shared IOA space's messages after position `after`."""
        return await self.client._call(
            self.client.relay.SpaceRead(relay_pb.SpaceReadRequest(space=space, after_seq=after), **self._opts()))


async def _watch(client: MeshClient, request: ev_pb.WatchEventsRequest, metadata) -> AsyncIterator[ev_pb.Event]:
    call = client.events.WatchEvents(request, metadata=metadata)
    try:
        async for response in call:
            for event in response.events:
                yield event
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from None
    finally:
        call.cancel()
