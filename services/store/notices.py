"""Dead-letter notices, the same on both stores: what a sender is told when its message was dead-lettered,
and when the notice crosses back over IOA instead (the sender is an IOA agent behind an inboxmesh relay):
then it goes into the outbox, and the relay sends it (docs/ioa.md, "Notices cross back")."""

from __future__ import annotations

from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from services.config import OUTBOX_LIMIT
from services.store.base import IOA_PREFIX, RESERVED_ID_PREFIX, EventRow, OutboxEntry

NOTICE = "inboxmesh-notice"
"""Header of a notice the mesh made; a message carrying it is never noticed about itself."""
RELAY = "inboxmesh-relay"
"""Header an inboxmesh relay writes on what it publishes, kept on the stored envelope: its receiving relay
answers, so a notice can cross back to the sender."""
NOTICE_TTL_US = 86_400 * 1_000_000
"""How long a notice waits in the outbox for the sender's node."""
MESH_ORIGIN = envelope_pb2.Origin(kind=envelope_pb2.ORIGIN_KIND_MESH)


def wanted(dead: envelope_pb2.Envelope, recipient: str) -> bool:
    """Whether the sender of a dead-lettered message is told: not for the mesh's own messages, notices
    (also ones that crossed from IOA), or a message to oneself."""
    return dead.origin.kind != envelope_pb2.ORIGIN_KIND_MESH and dead.sender != recipient and NOTICE not in dead.headers


def crosses(dead: envelope_pb2.Envelope) -> bool:
    """Whether the notice goes back over IOA (the sender is an IOA agent whose relay answers)."""
    return dead.sender.startswith(IOA_PREFIX) and RELAY in dead.headers


def notice(dead: envelope_pb2.Envelope, recipient: str, reason: str, at_us: int) -> envelope_pb2.Envelope:
    """The CONTROL notice for dead.sender (a local agent, or an IOA address), from `recipient`."""
    return envelope_pb2.Envelope(
        message_id=f"{RESERVED_ID_PREFIX}notice:{recipient}:{dead.sequence}", sender=recipient,
        recipient=dead.sender, kind=envelope_pb2.MESSAGE_KIND_CONTROL,
        content=envelope_pb2.Content(text=f"Your message {dead.message_id} to {recipient} was not consumed: {reason}."),
        in_reply_to=dead.message_id, conversation_id=dead.conversation_id, trace=dead.trace, origin=MESH_ORIGIN,
        headers={NOTICE: "dead-lettered", "inboxmesh-reason": reason}, created_at_us=at_us)


def crossing(dead: envelope_pb2.Envelope, recipient: str, reason: str, at_us: int) -> OutboxEntry:
    """The outbox entry of the notice that crosses back to an IOA sender."""
    return OutboxEntry(0, recipient, notice(dead, recipient, reason, at_us), at_us + NOTICE_TTL_US, at_us)


def crossing_events(entry: OutboxEntry, number: int, dead: envelope_pb2.Envelope, at_us: int) -> list[EventRow]:
    """What the record says of it: IOA_OUTBOXED with its entry, or NOTICE_UNDELIVERED when the outbox was
    full (number 0)."""
    env = entry.envelope
    if not number:
        return [EventRow(at_us, ev.EVENT_KIND_NOTICE_UNDELIVERED, entry.sender, message_id=env.message_id,
                         sender=entry.sender, recipient=env.recipient,
                         detail=f"the IOA outbox holds its limit of {OUTBOX_LIMIT}; {dead.message_id} was"
                                f" dead-lettered")]
    return [EventRow(at_us, ev.EVENT_KIND_IOA_OUTBOXED, entry.sender, message_id=env.message_id,
                     sender=entry.sender, recipient=env.recipient, seq=number, detail="dead-letter notice",
                     trace_id=trace_id_of(dead.trace.traceparent), in_reply_to=dead.message_id)]
