"""The two ways an MCP client reaches the server.

- stdio (`serve_stdio`): the client starts this process; the process is one MCP session, whose agent is
  opened before the first request is read and released when the client closes stdin.
- streamable HTTP (`McpHttpServer`): one agent per MCP session, opened when the session's handshake is
  done and released when the session ends (the client's DELETE, HTTP_IDLE_TIMEOUT_S idle, the server
  stopping). A session is what protocol 2025-11-25 and earlier have (`Mcp-Session-Id`); the
  2026-07-28 protocol has none, so this transport refuses its requests (its `server/discover` answers
  METHOD_NOT_FOUND, so a client that probes first falls back to the handshake). No authentication of its
  own: it listens on 127.0.0.1 only, and the SDK's DNS-rebinding protection admits loopback Host and
  Origin headers only.

"Released": the agent stops being subscribed; an agent the session registered is closed (its run ends,
and senders get TARGET_CLOSED), one bound by credential stays open.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any, cast

import anyio
import mcp_types as types
import uvicorn
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.subscriptions import InMemorySubscriptionBus
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.mesh import MeshClient
from inboxmesh.mcp.config import McpConfig
from inboxmesh.mcp.server import Attached, OneSession, attach, build_server

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
PATH = "/mcp"
GRACE_S = 3.0
"""Stopping the HTTP server: open requests and event streams are given this long, then cancelled."""
_ATTACHED = "inboxmesh.attached"
_OPENING = "inboxmesh.opening"
NO_SESSIONS = ("inboxmesh's HTTP transport keeps one agent per MCP session, and the 2026-07-28 protocol has no"
               " sessions: connect with the initialize handshake (protocol 2025-11-25; the Python SDK's"
               " mode='legacy'), or run `inboxmesh mcp --transport stdio`")


def _client(config: McpConfig) -> MeshClient:
    return MeshClient(config.mesh, timeout=config.timeout_s, tls=config.tls)


MAX_LINE_BYTES = 16 * 1024 * 1024
"""The longest JSON-RPC line read from stdin (a message is at most 256 KiB; arguments may be longer)."""


class _StdinLines:
    """stdin's lines, read by the event loop. The SDK's own reader blocks a worker thread in read(), which
    no cancellation interrupts: a server told to stop (SIGTERM) while its client keeps stdin open would
    wait for the client. This one is an asyncio pipe reader, cancelled like any task."""

    def __init__(self, reader: asyncio.StreamReader):
        self._reader = reader

    def __aiter__(self) -> _StdinLines:
        return self

    def end(self) -> None:
        """Read as if the client had closed stdin: the SDK's loop then ends as it does at EOF."""
        self._reader.feed_eof()

    async def __anext__(self) -> str:
        try:
            line = await self._reader.readline()
        except ValueError:  # over MAX_LINE_BYTES: dropped; the SDK answers the malformed line it sees
            log.warning("a line of over %d bytes on stdin was dropped", MAX_LINE_BYTES)
            return "\n"
        if not line:
            raise StopAsyncIteration
        return line.decode("utf-8", errors="replace")


async def _stdin_lines() -> _StdinLines | None:
    """stdin as _StdinLines; None when it is not a pipe, socket or terminal (a regular file: the SDK's
    reader then)."""
    reader = asyncio.StreamReader(limit=MAX_LINE_BYTES)
    pipe = os.fdopen(os.dup(0), "rb", buffering=0)
    try:
        await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    except (OSError, ValueError):
        pipe.close()
        return None
    return _StdinLines(reader)


async def serve_stdio(config: McpConfig, stop: asyncio.Event | None = None) -> None:
    """Serve one MCP client on this process's stdin and stdout until it closes stdin (or `stop` is set: a
    signal), then release the session's agent. Raises the MeshError that refused opening the agent (before
    anything is read)."""
    bus = InMemorySubscriptionBus()
    async with _client(config) as client:
        attached = await attach(client, config, bus)
        try:
            server = build_server(OneSession(attached), bus)
            lines = await _stdin_lines()
            # stdout stays the SDK's: it moves fd 1 to stderr while serving, so stray prints miss the wire
            async with stdio_server(stdin=cast("anyio.AsyncFile[str]", lines)) as (read_stream, write_stream):
                serving = asyncio.create_task(server.run(read_stream, write_stream,
                                                         server.create_initialization_options()))
                stopping = asyncio.create_task((stop or asyncio.Event()).wait())
                try:
                    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    if not serving.done() and lines is not None:
                        lines.end()  # stopped: end as at the client's EOF (calls in progress are cancelled)
                        await serving
                finally:
                    for task in (serving, stopping):
                        task.cancel()
                    await asyncio.gather(serving, stopping, return_exceptions=True)
                failure = None if serving.cancelled() else serving.exception()
                if failure is not None:
                    raise failure
        finally:  # not under cancellation: a signal only sets `stop`, so the agent is closed for sure
            await attached.session.close()


class PerSession:
    """streamable HTTP: one agent per MCP session, kept in the SDK's per-connection state and released by
    its per-connection teardown. A session's URL may name its agent (`/mcp?name=B`)."""

    def __init__(self, client: MeshClient, config: McpConfig, bus: InMemorySubscriptionBus):
        self.client = client
        self.config = config
        self.bus = bus

    async def of(self, ctx: ServerRequestContext[Any, Any]) -> Attached:
        # The SDK gives low-level handlers the connection only through the request's session object (its
        # own Context class exposes it as `connection`, but the runner hands handlers a
        # ServerRequestContext): read it there. One Connection per MCP session on the handshake path.
        connection = ctx.session._connection
        opening = connection.state.setdefault(_OPENING, asyncio.Lock())
        async with opening:
            attached: Attached | None = connection.state.get(_ATTACHED)
            if attached is None:
                name = ctx.request.query_params.get("name") if ctx.request is not None else None
                attached = await attach(self.client, self.config, self.bus, name or None)
                connection.state[_ATTACHED] = attached
                connection.exit_stack.push_async_callback(attached.session.close)
            return attached


async def _handshake_only(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Refuse 2026-07-28 (sessionless) requests on the HTTP transport (see the module's docstring)."""
    if ctx.request_id is not None and ctx.protocol_version in MODERN_PROTOCOL_VERSIONS:
        code = types.METHOD_NOT_FOUND if ctx.method == "server/discover" else types.INVALID_REQUEST
        raise MCPError(code, NO_SESSIONS)
    return await call_next(ctx)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, started and stopped by its owner instead of `serve()` (which would take over the
    process's SIGINT and SIGTERM): the steps of `serve()`, in the same order. The application's lifespan
    (the MCP session manager) is run by McpHttpServer, so that sessions end before connections are waited
    for."""

    async def start(self, sockets: list[socket.socket]) -> None:
        self.config.load()
        self.lifespan = self.config.lifespan_class(self.config)
        await self.startup(sockets=sockets)
        self._ticks = asyncio.create_task(self.main_loop(), name="mcp-http-ticks")

    async def stop(self, sockets: list[socket.socket]) -> None:
        self.should_exit = True
        ticks = getattr(self, "_ticks", None)
        if ticks is not None:
            await ticks
        await self.shutdown(sockets=sockets)


class McpHttpServer:
    """The streamable HTTP transport on 127.0.0.1:`config.port` (0: any free port), path /mcp.
    `await start()` (returns the URL), `await stop()` (safe twice)."""

    def __init__(self, config: McpConfig):
        self.config = config
        self.url = ""
        self._client: MeshClient | None = None
        self._socket: socket.socket | None = None
        self._uvicorn: _Uvicorn | None = None
        self._sessions: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    async def _run_sessions(self, manager: StreamableHTTPSessionManager, ready: asyncio.Event) -> None:
        """The session manager's life, in a task of its own (its task group must be entered and left by
        one task): until stop(), which ends every session (and releases its agent) by leaving it."""
        async with manager.run():
            ready.set()
            await self._stopping.wait()

    async def start(self) -> str:
        bus = InMemorySubscriptionBus()
        self._client = _client(self.config)
        server = build_server(PerSession(self._client, self.config, bus), bus)
        server.middleware.append(_handshake_only)
        app = server.streamable_http_app(streamable_http_path=PATH, host=HOST,
                                         session_idle_timeout=self.config.http_idle_timeout_s,
                                         max_sessions=self.config.max_http_sessions)
        ready = asyncio.Event()
        self._sessions = asyncio.create_task(self._run_sessions(server.session_manager, ready), name="mcp-sessions")
        started = asyncio.create_task(ready.wait())
        await asyncio.wait({self._sessions, started}, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if self._sessions.done():
            await self.stop()
            raise errors.Internal("the MCP session manager did not start (the log says why)")
        try:
            self._socket = socket.create_server((HOST, self.config.port))
        except OSError as exc:
            await self.stop()
            raise errors.Unavailable(f"cannot listen on {HOST}:{self.config.port}: {exc.strerror or exc}",
                                     reason=Reason.BIND_FAILED) from None
        self._socket.set_inheritable(False)
        self._uvicorn = _Uvicorn(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                                timeout_graceful_shutdown=int(GRACE_S)))
        await self._uvicorn.start([self._socket])
        port = self._socket.getsockname()[1]
        self.url = f"http://{HOST}:{port}{PATH}"
        return self.url

    async def stop(self) -> None:
        """Stop serving: sessions end (and their agents are released), then connections, then the mesh
        connection."""
        self._stopping.set()
        sessions, self._sessions = self._sessions, None
        if sessions is not None:
            await asyncio.gather(sessions, return_exceptions=True)
        server, self._uvicorn = self._uvicorn, None
        if server is not None and server.started:
            await server.stop([self._socket] if self._socket is not None else [])
        elif self._socket is not None:
            self._socket.close()
        self._socket = None
        client, self._client = self._client, None
        if client is not None:
            await client.close()
