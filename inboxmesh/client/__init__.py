"""The Python client of the mesh: everything a host in Python needs, and nothing of the server side.

    from inboxmesh.client import MeshClient, InboxStream, errors

- `mesh`: `MeshClient` (channel with deadlines and declared retries, one method per RPC) and
  `AgentHandle` (the calls an agent makes with its own credential), `envelope()`;
- `stream`: `InboxStream`, following one or more inboxes over one Consume stream, with resubscribe;
- `errors`: the exception hierarchy a failed call is raised as, and `Reason`, every reason the mesh
  puts in `google.rpc.ErrorInfo`; `status`: the table between them and gRPC status codes;
- `credentials`, `addressing`: the wire formats of credentials and of non-agent addresses;
- `tracing`: W3C trace context carried in envelopes, and the OpenTelemetry set-up.

This package imports only the generated protos (`inboxmesh.<service>.v1`) and third-party libraries;
tests/test_layers.py fails when it imports anything else of ours.
"""

from inboxmesh.client import errors
from inboxmesh.client.errors import MeshError
from inboxmesh.client.mesh import AgentHandle, MeshClient, envelope
from inboxmesh.client.stream import InboxStream

__all__ = ["AgentHandle", "InboxStream", "MeshClient", "MeshError", "envelope", "errors"]
