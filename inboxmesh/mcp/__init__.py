"""An MCP server that gives any MCP client an agent of its own in the mesh (`inboxmesh mcp`).

- `config`: what the server is told (the mesh, who each session is, the bounds);
- `session`: one session's agent: its inbox on one Consume stream, takes that consume, sends, replies;
- `tools`: the MCP tools (whoami, list_agents, send_message, reply, take_messages) and their results;
- `server`: the SDK's low-level Server with those tools and the `inbox://<agent_id>` resource;
- `transports`: stdio (one process, one session) and streamable HTTP (one agent per session).

A client of the mesh like the CLI: it imports only `inboxmesh.client` and the generated protos
(tests/test_layers.py). What it guarantees and how to use it: docs/interop.md.
"""

from inboxmesh.mcp.config import Identity, McpConfig
from inboxmesh.mcp.transports import McpHttpServer, serve_stdio

__all__ = ["Identity", "McpConfig", "McpHttpServer", "serve_stdio"]
