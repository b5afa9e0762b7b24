"""Addresses of the wire contract that are not agent ids (docs/delivery-contract.md)."""

from __future__ import annotations

IOA_PREFIX = "ioa:"
"""Senders and recipients that are addresses on the IOA network, not agents here."""
CHANNEL_PREFIX = "channel:"
"""Senders that are people on an outside channel (routing ingress), not agents."""
EXTERNAL_PREFIXES = (IOA_PREFIX, CHANNEL_PREFIX)
RESERVED_ID_PREFIX = "inboxmesh:"
"""Message ids the mesh itself uses (notices, announcements); senders may not use them."""
