"""Credentials on the wire: a credential is `<agent_id>.<secret>` (as RegisterAgent returns it), sent as
`authorization: Bearer <credential>` call metadata. Issuing and checking them is the mesh's job
(services/auth.py); this is the part both sides read."""

from __future__ import annotations

from collections.abc import Iterable

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason

METADATA_KEY = "authorization"
SCHEME = "Bearer "


def agent_id_of(credential: str) -> str:
    """The agent id a credential claims to belong to (not yet verified)."""
    agent_id, dot, secret = credential.partition(".")
    if not dot or not agent_id or not secret:
        raise errors.Unauthenticated(
            "malformed credential: expected '<agent_id>.<secret>' as returned by RegisterAgent",
            reason=Reason.MALFORMED_CREDENTIAL,
        )
    return agent_id


def bearer_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The bearer token in `authorization` metadata, or None when absent."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            text = value.decode() if isinstance(value, bytes) else value
            if not text.startswith(SCHEME):
                raise errors.Unauthenticated(
                    "authorization metadata must be 'Bearer <credential>'", reason=Reason.MALFORMED_CREDENTIAL
                )
            return text[len(SCHEME) :].strip()
    return None


def metadata_for(credential: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that authenticates as credential."""
    return ((METADATA_KEY, SCHEME + credential),)
