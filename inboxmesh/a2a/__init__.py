"""The A2A gateway (`inboxmesh a2a`, docs/interop.md): a mesh agent exposed as an A2A agent (Agent Card,
JSON-RPC and gRPC bindings through a2a-sdk), and `a2a:<agent card URL>` addresses for the mesh's agents."""

from inboxmesh.a2a.gateway import A2aConfig, Gateway
from inboxmesh.a2a.server import A2aServer

__all__ = ["A2aConfig", "A2aServer", "Gateway"]
