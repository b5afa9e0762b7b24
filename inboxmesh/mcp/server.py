"""The MCP server: the official SDK's low-level `Server` (mcp 2.x), its handlers in front of one
AgentSession per MCP session.

- Tools: inboxmesh.mcp.tools.
- Resource `inbox://<agent_id>`: what waits in the session's inbox (JSON: the count and ids of the
  messages delivered to this server that no take has consumed). When messages arrive that were not there
  before, the server says so with `notifications/resources/updated` for that URI: to a client that sent
  `resources/subscribe` (protocol 2025-11-25 and earlier, on the connection's own stream), and on every
  `subscriptions/listen` stream that names the URI (protocol 2026-07-28).
- Which agent a request acts as comes from its `Sessions`: one agent for the process (stdio), or one per
  MCP session (streamable HTTP; transports.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Protocol

import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.session import ServerSession
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourceUpdated
from mcp.shared.exceptions import MCPError

from inboxmesh.client import errors
from inboxmesh.client.mesh import MeshClient
from inboxmesh.mcp import tools
from inboxmesh.mcp.config import McpConfig
from inboxmesh.mcp.session import AgentSession, open_agent

log = logging.getLogger(__name__)

NOTIFY_TIMEOUT_S = 5.0
"""A change notification that cannot be written within this long is dropped (the client reads the
resource when it next looks; the messages wait all the same)."""
INSTRUCTIONS = (
    "You are an agent in an inboxmesh mesh: other agents send you messages and you send them yours. "
    "take_messages takes (consumes) the next messages from your inbox, waiting up to wait_s seconds; "
    "reply answers one of them; send_message writes to any agent of your tree by id or name; list_agents "
    "shows who is there. Every send returns the mesh's receipt."
)


class Attached:
    """One MCP session's AgentSession, and who is told when messages arrive in its inbox."""

    def __init__(self, session: AgentSession, bus: InMemorySubscriptionBus):
        self.session = session
        self.bus = bus
        self.subscriber: ServerSession | None = None
        """The connection that asked `resources/subscribe` for the inbox (2025-era protocol)."""
        session.on_arrival = self.announce

    async def announce(self) -> None:
        """Messages arrived: tell the subscribed connection, and every listen stream naming the inbox."""
        uri = self.session.uri
        try:
            if self.subscriber is not None:
                await asyncio.wait_for(self.subscriber.send_resource_updated(uri), NOTIFY_TIMEOUT_S)
            await asyncio.wait_for(self.bus.publish(ResourceUpdated(uri=uri)), NOTIFY_TIMEOUT_S)
        except TimeoutError:
            log.warning("the inbox notification for %s was not written within %gs; dropped", uri, NOTIFY_TIMEOUT_S)
        except Exception:  # a notification is advice: the stream's reader (the caller) must go on reading
            log.warning("the inbox notification for %s failed; dropped", uri, exc_info=True)


async def attach(client: MeshClient, config: McpConfig, bus: InMemorySubscriptionBus,
                 name: str | None = None) -> Attached:
    """Open the agent one MCP session is (inboxmesh.mcp.session.open_agent) and subscribe its inbox."""
    agent, owned, first_turn = await open_agent(client, config.identity, name)
    session = AgentSession(agent, owned=owned, max_waiting=config.max_waiting, first_turn=first_turn)
    attached = Attached(session, bus)
    await session.start(config.timeout_s)
    log.info("MCP session is agent %s (%s, %s)", agent.agent_id, agent.info.name,
             "registered" if owned else "bound by credential")
    return attached


class Sessions(Protocol):
    """Which agent a request acts as."""

    async def of(self, ctx: ServerRequestContext[Any, Any]) -> Attached:
        """The session's Attached; raises the MeshError that refused opening it."""
        ...


class OneSession:
    """stdio: the process is one MCP session, and its agent was opened before the first request."""

    def __init__(self, attached: Attached):
        self.attached = attached

    async def of(self, ctx: ServerRequestContext[Any, Any]) -> Attached:
        return self.attached


def _mcp_error(exc: errors.MeshError) -> MCPError:
    return MCPError(types.INTERNAL_ERROR, f"{exc.reason}: {exc.message}")


def build_server(sessions: Sessions, bus: InMemorySubscriptionBus) -> Server[Any]:
    """The low-level MCP server whose handlers act as the agent `sessions` gives each request."""

    async def list_tools(ctx: ServerRequestContext[Any, Any],
                         params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tools.TOOLS)

    async def call_tool(ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
                        ) -> types.CallToolResult:
        if params.name not in tools.TOOL_NAMES:
            raise MCPError(types.INVALID_PARAMS, f"Unknown tool: {params.name}; the tools: "
                           + ", ".join(sorted(tools.TOOL_NAMES)))
        try:
            attached = await sessions.of(ctx)
        except errors.MeshError as exc:  # the session's agent could not be opened (mesh away, bad parent)
            return tools.refusal(exc)
        # HTTP: the SDK runs the call apart from its request's connection, so the take asks it whether the
        # client is still there before consuming anything (stdio: a client gone ends the process)
        abandoned = ctx.request.is_disconnected if ctx.request is not None else None
        return await tools.call(attached.session, params.name, params.arguments, abandoned)

    async def inbox(ctx: ServerRequestContext[Any, Any], uri: str | None = None) -> Attached:
        try:
            attached = await sessions.of(ctx)
        except errors.MeshError as exc:
            raise _mcp_error(exc) from None
        if uri is not None and uri != attached.session.uri:
            raise MCPError(types.INVALID_PARAMS, f"unknown resource {uri[:100]!r}: this session's inbox is"
                           f" {attached.session.uri}")
        return attached

    async def list_resources(ctx: ServerRequestContext[Any, Any],
                             params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
        session = (await inbox(ctx)).session
        return types.ListResourcesResult(resources=[types.Resource(
            uri=session.uri, name="inbox", mime_type="application/json",
            description="Messages waiting in your inbox that take_messages has not taken yet: count and ids.")])

    async def read_resource(ctx: ServerRequestContext[Any, Any], params: types.ReadResourceRequestParams
                            ) -> types.ReadResourceResult:
        session = (await inbox(ctx, params.uri)).session
        waiting = session.waiting()
        body = {"agent_id": session.agent_id, "waiting": len(waiting),
                "message_ids": [m.message_id for m in waiting],
                "limit": session.max_waiting,
                "note": f"at most {session.max_waiting} are delivered to this server at a time; more wait"
                        " stored in the mesh until take_messages takes some"}
        return types.ReadResourceResult(contents=[types.TextResourceContents(
            uri=session.uri, mime_type="application/json", text=json.dumps(body))])

    async def subscribe(ctx: ServerRequestContext[Any, Any], params: types.SubscribeRequestParams
                        ) -> types.EmptyResult:
        (await inbox(ctx, params.uri)).subscriber = ctx.session
        return types.EmptyResult()

    async def unsubscribe(ctx: ServerRequestContext[Any, Any], params: types.UnsubscribeRequestParams
                          ) -> types.EmptyResult:
        (await inbox(ctx, params.uri)).subscriber = None
        return types.EmptyResult()

    async def initialized(ctx: ServerRequestContext[Any, Any], params: types.NotificationParams) -> None:
        """A session's handshake is done: open its agent now ("registered on connect"), not at its first
        call. A failure here is logged; the session's first call tries again and reports it."""
        try:
            await sessions.of(ctx)
        except errors.MeshError as exc:
            log.warning("could not open the agent of a new MCP session: %s: %s", exc.reason, exc.message)

    server: Server[Any] = Server(
        "inboxmesh", version=_version(), instructions=INSTRUCTIONS,
        on_list_tools=list_tools, on_call_tool=call_tool, on_list_resources=list_resources,
        on_read_resource=read_resource, on_subscribe_resource=subscribe, on_unsubscribe_resource=unsubscribe,
        on_subscriptions_listen=ListenHandler(bus))
    server.add_notification_handler("notifications/initialized", types.NotificationParams, initialized)
    return server


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("inboxmesh")
    except PackageNotFoundError:
        return ""
