"""What `inboxmesh mcp` is told: where the mesh is, who each MCP session is in it, and the bounds. Frozen;
the command line (inboxmesh/cli/main.py) reads flags and environment variables into it, nothing here
reads either."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

MAX_WAITING = 100
"""The most messages the mesh delivers to one session's server without a take acking them (the Consume
stream's max_in_flight): more wait in the mesh, stored, until take_messages consumes some."""
MAX_HTTP_SESSIONS = 1000
"""The most MCP sessions (so agents and Consume streams) the HTTP transport serves at once; a client that
would open one more is answered HTTP 503 until one ends."""
HTTP_IDLE_TIMEOUT_S = 1800.0
"""An HTTP session with no request in flight and no event stream open for this long ends (the MCP SDK's
default), and with it the agent registered for it."""


@dataclass(frozen=True)
class Identity:
    """Who an MCP session is in the mesh. One of: a new top-level agent named `name`, a new child of the
    agent whose credential is `parent_credential` (also named `name`), or the existing agent whose
    credential is `credential`."""

    name: str = "mcp"
    """Name of the agent registered for a session (over HTTP a session's URL may choose its own:
    `/mcp?name=B`). Names are for lookup; ids are addresses."""
    credential: str | None = field(default=None, repr=False)
    """Bind every session to this existing agent instead of registering one. It stays open when the
    session ends; a newer session bound to it takes its inbox over (SUPERSEDED)."""
    parent_credential: str | None = field(default=None, repr=False)
    """Register each session's agent as a child of this agent (its credential), so siblings share a
    scope and can find each other by name."""


@dataclass(frozen=True)
class McpConfig:
    """One `inboxmesh mcp` process."""

    mesh: str
    """gRPC target of the mesh (host:port)."""
    identity: Identity = field(default_factory=Identity)
    """Who each session is in the mesh."""
    timeout_s: float = 10.0
    """Deadline of each call to the mesh."""
    tls: grpc.ChannelCredentials | None = field(default=None, repr=False)
    """TLS to the mesh; plaintext when None."""
    port: int = 0
    """HTTP transport: the port on 127.0.0.1 (0: any free port). The HTTP transport has no authentication
    of its own, so it listens on loopback only."""
    max_waiting: int = MAX_WAITING
    """Per session: the most messages delivered to this server and not yet taken (MAX_WAITING)."""
    max_http_sessions: int = MAX_HTTP_SESSIONS
    """HTTP transport: the most sessions at once (MAX_HTTP_SESSIONS)."""
    http_idle_timeout_s: float = HTTP_IDLE_TIMEOUT_S
    """HTTP transport: a session idle this long ends (HTTP_IDLE_TIMEOUT_S)."""
