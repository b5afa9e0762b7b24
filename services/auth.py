"""Credentials: issuing them, reading them from call metadata, checking them.

A credential is `<agent_id>.<secret>`. The mesh stores only the SHA-256 of
the whole credential, so a stolen database does not let anyone send as an
agent. The agent id prefix lets the mesh find the agent without a scan.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from inboxmesh.client.credentials import (  # re-exported: the wire format both sides read
    METADATA_KEY as METADATA_KEY,
)
from inboxmesh.client.credentials import (
    SCHEME as SCHEME,
)
from inboxmesh.client.credentials import (
    agent_id_of as agent_id_of,
)
from inboxmesh.client.credentials import (
    bearer_from_metadata as bearer_from_metadata,
)
from inboxmesh.client.credentials import (
    metadata_for as metadata_for,
)

BOUND_TO = "inboxmesh.bound_to"
"""Agent metadata key: the client-certificate identity the agent was registered from, when the mesh binds
credentials (`--bind-credentials`); set by the mesh only (a registration's own value is dropped)."""


def new_agent_id() -> str:
    return "agt_" + secrets.token_hex(10)


def new_credential(agent_id: str) -> str:
    return f"{agent_id}.{secrets.token_urlsafe(32)}"


def agent_id_for(parent_id: str, request_id: str) -> str:
    """The agent an idempotent registration names: always the same for the
    same (parent, request_id)."""
    return "agt_" + hashlib.sha256(f"agent\x00{parent_id}\x00{request_id}".encode()).hexdigest()[:20]


def credential_for(agent_id: str, request_id: str) -> str:
    """The credential of an idempotent registration, derived from its secret
    request_id, so a retry can be answered with the same credential (only
    its hash is stored)."""
    secret = base64.urlsafe_b64encode(
        hashlib.sha256(f"credential\x00{agent_id}\x00{request_id}".encode()).digest()).decode().rstrip("=")
    return f"{agent_id}.{secret}"


def credential_hash(credential: str) -> bytes:
    return hashlib.sha256(credential.encode()).digest()


def hashes_match(credential: str, stored_hash: bytes) -> bool:
    return hmac.compare_digest(credential_hash(credential), stored_hash)


def secrets_match(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets of any characters (hmac.compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))
