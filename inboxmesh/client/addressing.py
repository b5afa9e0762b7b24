"""Addresses of the wire contract that are not agent ids (docs/delivery-contract.md)."""

from __future__ import annotations

IOA_PREFIX = "ioa:"
"""Senders and recipients that are addresses on the IOA network, not agents here."""
CHANNEL_PREFIX = "channel:"
"""Senders that are people on an outside channel (routing ingress), not agents."""
A2A_PREFIX = "a2a:"
"""Agents reached through the mesh's A2A gateway (docs/interop.md): `a2a:<agent card URL>` for an A2A agent
elsewhere, `a2a:client/<principal>` for a caller of an agent this mesh exposes over A2A."""
A2A_TO_HEADER = "inboxmesh-a2a-to"
"""On a message stored in the A2A gateway agent's inbox: the `a2a:` address it was sent to."""
EXTERNAL_PREFIXES = (IOA_PREFIX, CHANNEL_PREFIX, A2A_PREFIX)
RESERVED_ID_PREFIX = "inboxmesh:"
"""Message ids the mesh itself uses (notices, announcements); senders may not use them."""
