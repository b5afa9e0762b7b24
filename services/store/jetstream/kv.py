"""Small helpers of the JetStream store: key encoding, compare-and-set loops
on key-value entries, and the JSON form of agent and message records."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2
from services.store.base import AgentRecord, MessageRecord

_SAFE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
MAX_CAS_TRIES = 100


def token(value: str) -> str:
    """A key / subject token for any string: itself when safe, else a hash."""
    if _SAFE.fullmatch(value):
        return value
    return "h" + hashlib.sha256(value.encode()).hexdigest()[:32]


def idem_key(sender: str, message_id: str) -> str:
    return "i." + hashlib.sha256(f"{sender}\x00{message_id}".encode()).hexdigest()


def msg_id_header(sender: str, message_id: str) -> str:
    """The Nats-Msg-Id of a message: JetStream's own de-duplication key."""
    return hashlib.sha256(f"{sender}\x00{message_id}".encode()).hexdigest()


async def get(kv: KeyValue, key: str) -> tuple[Any, int] | None:
    """(decoded JSON value, revision) or None."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    if entry.value is None:
        return None
    return json.loads(entry.value), entry.revision


async def create(kv: KeyValue, key: str, value: Any, *, raw: bool = False) -> int:
    """Create the key (value as JSON, or bytes with raw): its revision, or 0
    when it exists (somebody else won)."""
    try:
        return await kv.create(key, value if raw else json.dumps(value).encode())
    except KeyWrongLastSequenceError:
        return 0


async def cas(kv: KeyValue, key: str, change: Callable[[Any | None], Any | None]) -> Any | None:
    """Read, change, write back only if nobody wrote in between; retried.
    `change` gets the current value (None when absent) and returns the new
    one, or None to leave the entry alone. Returns what was written (or
    None)."""
    for _ in range(MAX_CAS_TRIES):
        found = await get(kv, key)
        current, revision = found if found else (None, 0)
        new = change(current)
        if new is None:
            return None
        try:
            if found is None:
                await kv.create(key, json.dumps(new).encode())
            else:
                await kv.update(key, json.dumps(new).encode(), last=revision)
            return new
        except KeyWrongLastSequenceError:
            continue
    raise errors.Unavailable(f"too much contention on {key}; nothing changed", reason=Reason.CONTENTION)


# -- records --------------------------------------------------------------------
def agent_json(record: AgentRecord) -> dict:
    return {
        "agent_id": record.agent_id, "name": record.name, "mode": record.mode, "parent_id": record.parent_id,
        "scope_id": record.scope_id, "depth": record.depth, "state": record.state, "metadata": record.metadata,
        "inbox_capacity": record.inbox_capacity, "created_at_us": record.created_at_us,
        "credential_hash": record.credential_hash.hex(), "closed_at_us": record.closed_at_us,
        "close_reason": record.close_reason,
    }


def agent_of(data: dict) -> AgentRecord:
    return AgentRecord(**{**data, "credential_hash": bytes.fromhex(data["credential_hash"])})


def envelope_b64(envelope: envelope_pb2.Envelope) -> str:
    return base64.b64encode(envelope.SerializeToString()).decode()


def message_of(state: dict) -> MessageRecord:
    """A message record from its state entry (which holds the envelope)."""
    envelope = envelope_pb2.Envelope.FromString(base64.b64decode(state["env"]))
    envelope.delivery_attempt = state.get("attempts", 0)
    return MessageRecord(
        envelope=envelope, state=state["state"], attempts=state.get("attempts", 0), stored_at_us=state["stored"],
        delivered_at_us=state.get("delivered", 0), consumed_at_us=state.get("consumed", 0),
        dead_at_us=state.get("dead", 0), dead_reason=state.get("reason", ""))
