"""Inboxes on SQLite: append with receipts, delivery, exactly-once acks, dead letters and the notices
they send, the loop guard's frontier. Write operations run inside the writer's transaction
(services.store.sqlite.writer) and append the event rows they cause; nothing here commits. Reads run on
the connection between commits."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from services.config import OUTBOX_LIMIT
from services.store import base
from services.store import notices as notices_of
from services.store.base import (
    ACCEPTED,
    AGENT_OPEN,
    CONSUMED,
    DEAD_LETTERED,
    DELIVERED,
    DUPLICATE,
    INBOX_FULL,
    NOT_PERMITTED,
    QUEUED,
    RECEIPT_NAME,
    TARGET_CLOSED,
    AckOutcome,
    AppendItem,
    DeliveryBatch,
    EventRow,
    Frontier,
    MessageRecord,
    SendOutcome,
)
from services.store.sqlite import outbox
from services.store.sqlite.schema import MESSAGE_COLUMNS, message_of


class Inbox:
    """The counters of one recipient, loaded once per operation."""

    __slots__ = ("agent_id", "state", "capacity", "unconsumed", "next_seq", "dirty")

    def __init__(self, agent_id: str, row: tuple):
        self.agent_id = agent_id
        self.state, self.capacity, self.unconsumed, self.next_seq = row
        self.dirty = False

    @staticmethod
    def load(conn: sqlite3.Connection, agent_id: str) -> Inbox | None:
        row = conn.execute(
            "SELECT state, inbox_capacity, unconsumed, next_seq FROM agents WHERE agent_id = ?", (agent_id,)
        ).fetchone()
        return Inbox(agent_id, row) if row else None

    def save(self, conn: sqlite3.Connection) -> None:
        if self.dirty:
            conn.execute("UPDATE agents SET next_seq = ?, unconsumed = ? WHERE agent_id = ?",
                         (self.next_seq, self.unconsumed, self.agent_id))
            self.dirty = False


def store_envelope(conn: sqlite3.Connection, inbox: Inbox, env: envelope_pb2.Envelope, at_us: int) -> int:
    """Put an envelope into an inbox that has room; returns its sequence."""
    seq = inbox.next_seq
    inbox.next_seq += 1
    inbox.unconsumed += 1
    inbox.dirty = True
    env.sequence = seq
    env.stored_at_us = at_us
    env.delivery_attempt = 0
    conn.execute(
        "INSERT INTO messages (recipient, seq, sender, message_id, state, envelope, traceparent, stored_at_us,"
        " expires_at_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (inbox.agent_id, seq, env.sender, env.message_id, QUEUED, env.SerializeToString(), env.trace.traceparent,
         at_us, env.expires_at_us),
    )
    return seq


# -- inbox --------------------------------------------------------------------
def append(conn: sqlite3.Connection, events: list[EventRow], sender_id: str, items: list[AppendItem],
           at_us: int) -> list[SendOutcome]:
    if sender_id.startswith(base.EXTERNAL_PREFIXES):
        sender_open = True  # a peer on the IOA network or a channel, speaking through the relay or ingress
    else:
        sender_row = conn.execute("SELECT state FROM agents WHERE agent_id = ?", (sender_id,)).fetchone()
        sender_open = sender_row is not None and sender_row[0] == AGENT_OPEN
    inboxes: dict[str, Inbox | None] = {}
    outcomes: list[SendOutcome] = []
    for item in items:
        env = item.envelope
        mid, rid = env.message_id, env.recipient
        original = conn.execute(
            "SELECT recipient, seq, stored_at_us FROM messages WHERE sender = ? AND message_id = ?",
            (sender_id, mid),
        ).fetchone()
        if original is not None:
            outcome = SendOutcome(mid, original[0], DUPLICATE, original[1], original[2],
                                  "already accepted from this sender; nothing stored again")
        elif item.rejection is not None:
            outcome = SendOutcome(mid, rid, item.rejection[0], detail=item.rejection[1])
        elif not sender_open:
            outcome = SendOutcome(mid, rid, NOT_PERMITTED, detail=f"sender {sender_id} is closed")
        else:
            if rid not in inboxes:
                inboxes[rid] = Inbox.load(conn, rid)
            inbox = inboxes[rid]
            if inbox is None:
                outcome = SendOutcome(mid, rid, base.UNKNOWN_TARGET, detail=f"no agent {rid}")
            elif inbox.state != AGENT_OPEN:
                outcome = SendOutcome(mid, rid, TARGET_CLOSED, detail=f"agent {rid} is closed")
            elif inbox.unconsumed >= inbox.capacity:
                outcome = SendOutcome(
                    mid, rid, INBOX_FULL,
                    detail=f"agent {rid} holds {inbox.unconsumed} unconsumed messages (capacity {inbox.capacity});"
                           " nothing was evicted, retry after it consumes")
            elif item.conversation_budget and env.conversation_id and not _within_budget(
                    conn, env.conversation_id, item.conversation_budget):
                outcome = SendOutcome(
                    mid, rid, NOT_PERMITTED,
                    detail=f"loop guard: conversation {env.conversation_id} has used its budget of"
                           f" {item.conversation_budget} messages")
            else:
                env.sender = sender_id
                seq = store_envelope(conn, inbox, env, at_us)
                outcome = SendOutcome(mid, rid, ACCEPTED, seq, at_us, envelope=env)
        sent = EventRow(at_us, ev.EVENT_KIND_MESSAGE_SENT, outcome.recipient, message_id=mid, sender=sender_id,
                        recipient=outcome.recipient, seq=outcome.sequence, detail=RECEIPT_NAME[outcome.status],
                        trace_id=trace_id_of(env.trace.traceparent), in_reply_to=env.in_reply_to,
                        conversation_id=env.conversation_id)
        events.append(sent)
        if outcome.status == ACCEPTED:
            events.append(replace(sent, kind=ev.EVENT_KIND_MESSAGE_STORED, agent_id=rid, detail=""))
        outcomes.append(outcome)
    for inbox in inboxes.values():
        if inbox is not None:
            inbox.save(conn)
    return outcomes


def _within_budget(conn: sqlite3.Connection, conversation_id: str, budget: int) -> bool:
    """Count one more message of the conversation unless its budget is used up."""
    row = conn.execute("SELECT messages FROM conversations WHERE conversation_id = ?", (conversation_id,)).fetchone()
    if row is not None and row[0] >= budget:
        return False
    conn.execute("INSERT INTO conversations (conversation_id, messages) VALUES (?, 1)"
                 " ON CONFLICT(conversation_id) DO UPDATE SET messages = messages + 1", (conversation_id,))
    return True


def dead_letter(conn: sqlite3.Connection, events: list[EventRow], recipient: str, records: list[MessageRecord],
                reason: str, at_us: int) -> tuple[list[MessageRecord], list[envelope_pb2.Envelope]]:
    """Dead-letter unconsumed messages of one inbox; tell each sender that is
    still open with a CONTROL notice in its inbox. Returns (dead, notices)."""
    dead, notices = [], []
    senders: dict[str, Inbox | None] = {}
    for record in records:
        env = record.envelope
        conn.execute(
            "UPDATE messages SET state = ?, dead_at_us = ?, dead_reason = ? WHERE recipient = ? AND seq = ?",
            (DEAD_LETTERED, at_us, reason, recipient, env.sequence))
        conn.execute("INSERT INTO dead_letters (recipient, seq, sender) VALUES (?, ?, ?)",
                     (recipient, env.sequence, env.sender))
        events.append(EventRow(at_us, ev.EVENT_KIND_MESSAGE_DEAD_LETTERED, recipient, message_id=env.message_id,
                                sender=env.sender, recipient=recipient, seq=env.sequence, detail=reason,
                                trace_id=trace_id_of(env.trace.traceparent)))
        dead.append(replace(record, state=DEAD_LETTERED, dead_at_us=at_us, dead_reason=reason))
        if not notices_of.wanted(env, recipient):
            continue  # no notices about notices, nor to oneself
        if notices_of.crosses(env):  # to an IOA sender: through the outbox, in this same transaction
            entry = notices_of.crossing(env, recipient, reason, at_us)
            added, = outbox.add(conn, events, [entry], OUTBOX_LIMIT)
            events += notices_of.crossing_events(entry, added.number, env, at_us)
            continue
        if env.sender not in senders:
            senders[env.sender] = Inbox.load(conn, env.sender)
        notice = _notice(conn, events, senders[env.sender], env, recipient, reason, at_us)
        if notice is not None:
            notices.append(notice)
    conn.execute("UPDATE agents SET unconsumed = unconsumed - ? WHERE agent_id = ?", (len(dead), recipient))
    for inbox in senders.values():
        if inbox is not None:
            inbox.save(conn)
    return dead, notices


def _notice(conn: sqlite3.Connection, events: list[EventRow], inbox: Inbox | None, dead: envelope_pb2.Envelope,
            recipient: str, reason: str, at_us: int) -> envelope_pb2.Envelope | None:
    if inbox is None or inbox.state != AGENT_OPEN:
        return None
    message_id = f"{base.RESERVED_ID_PREFIX}notice:{recipient}:{dead.sequence}"
    if inbox.unconsumed >= inbox.capacity:
        events.append(EventRow(at_us, ev.EVENT_KIND_NOTICE_UNDELIVERED, inbox.agent_id, message_id=message_id,
                                sender=recipient, recipient=inbox.agent_id,
                                detail=f"inbox full; {dead.message_id} was dead-lettered: {reason}"))
        return None
    notice = notices_of.notice(dead, recipient, reason, at_us)
    seq = store_envelope(conn, inbox, notice, at_us)
    events.append(EventRow(at_us, ev.EVENT_KIND_MESSAGE_STORED, inbox.agent_id, message_id=message_id,
                            sender=recipient, recipient=inbox.agent_id, seq=seq, detail="dead-letter notice",
                            trace_id=trace_id_of(dead.trace.traceparent), in_reply_to=dead.message_id))
    return notice


def next_deliveries(conn: sqlite3.Connection, events: list[EventRow], recipient: str, after_sequence: int, limit: int,
                    max_attempts: int, now_us: int) -> DeliveryBatch:
    state = conn.execute("SELECT state, close_reason FROM agents WHERE agent_id = ?", (recipient,)).fetchone()
    if state is None or state[0] != AGENT_OPEN:
        return DeliveryBatch([], [], recipient_open=False, close_reason=state[1] if state else "unknown agent")
    rows = conn.execute(
        f"SELECT expires_at_us, {MESSAGE_COLUMNS} FROM messages"
        " WHERE recipient = ? AND seq > ? AND state IN (1, 2) ORDER BY seq LIMIT ?",
        (recipient, after_sequence, limit),
    ).fetchall()
    deliver, expired, exhausted = [], [], []
    for row in rows:
        expires_at, record = row[0], message_of(row[1:])
        if expires_at and expires_at <= now_us:
            expired.append(record)
        elif record.attempts >= max_attempts:
            exhausted.append(record)
        else:
            deliver.append(record)
    dead, notices = dead_letter(conn, events, recipient, expired, base.REASON_EXPIRED, now_us)
    more = dead_letter(conn, events, recipient, exhausted, base.REASON_ATTEMPTS, now_us)
    dead, notices = dead + more[0], notices + more[1]
    envelopes = []
    for record in deliver:
        env = record.envelope
        attempt = record.attempts + 1
        conn.execute(
            "UPDATE messages SET state = ?, attempts = ?,"
            " delivered_at_us = CASE delivered_at_us WHEN 0 THEN ? ELSE delivered_at_us END"
            " WHERE recipient = ? AND seq = ?",
            (DELIVERED, attempt, now_us, recipient, env.sequence))
        events.append(delivered_row(recipient, env, attempt, now_us))
        env.delivery_attempt = attempt
        envelopes.append(env)
    return DeliveryBatch(envelopes, dead, recipient_open=True, notices=notices)


def delivered_row(recipient: str, env: envelope_pb2.Envelope, attempt: int, at_us: int) -> EventRow:
    """The delivered event of one delivery attempt."""
    return EventRow(at_us, ev.EVENT_KIND_MESSAGE_DELIVERED, recipient, message_id=env.message_id, sender=env.sender,
                    recipient=recipient, seq=env.sequence, detail=f"attempt={attempt}",
                    trace_id=trace_id_of(env.trace.traceparent), in_reply_to=env.in_reply_to,
                    conversation_id=env.conversation_id)


def mark_delivered(conn: sqlite3.Connection, events: list[EventRow], recipient: str, delivered: list[EventRow],
                   at_us: int) -> None:
    """delivered: the first delivered events (delivered_row, attempt 1) of messages streamed from memory;
    each is recorded when its message was still queued."""
    for row in delivered:
        cur = conn.execute(
            "UPDATE messages SET state = ?, attempts = 1, delivered_at_us = ? WHERE recipient = ? AND seq = ?"
            " AND state = ?", (DELIVERED, at_us, recipient, row.seq, QUEUED))
        if cur.rowcount:
            events.append(row)


def ack(conn: sqlite3.Connection, events: list[EventRow], recipient: str, sequences: list[int], at_us: int,
        turn: int) -> list[AckOutcome]:
    outcomes = []
    consumed: list[envelope_pb2.Envelope] = []
    for seq in sequences:
        row = conn.execute(
            "SELECT state, message_id, sender, traceparent, envelope FROM messages WHERE recipient = ? AND seq = ?",
            (recipient, seq)).fetchone()
        if row is None:
            outcomes.append(AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND))
            continue
        state, mid, sender, traceparent, blob = row
        if state == CONSUMED:
            outcomes.append(AckOutcome(seq, mid, inbox_pb2.ACK_STATUS_ALREADY_CONSUMED))
        elif state == DEAD_LETTERED:
            outcomes.append(AckOutcome(seq, mid, inbox_pb2.ACK_STATUS_DEAD_LETTERED))
        else:
            conn.execute("UPDATE messages SET state = ?, consumed_at_us = ? WHERE recipient = ? AND seq = ?",
                         (CONSUMED, at_us, recipient, seq))
            consumed.append(env := envelope_pb2.Envelope.FromString(blob))
            events.append(EventRow(at_us, ev.EVENT_KIND_MESSAGE_CONSUMED, recipient, message_id=mid, sender=sender,
                                    recipient=recipient, seq=seq, trace_id=trace_id_of(traceparent), turn=turn,
                                    in_reply_to=env.in_reply_to, conversation_id=env.conversation_id))
            outcomes.append(AckOutcome(seq, mid, inbox_pb2.ACK_STATUS_CONSUMED, traceparent, env))
    if consumed:
        conn.execute("UPDATE agents SET unconsumed = unconsumed - ? WHERE agent_id = ?", (len(consumed), recipient))
        frontier = Frontier.of(consumed)
        assert frontier is not None
        conn.execute("INSERT OR REPLACE INTO frontiers (agent_id, hop_count, trail) VALUES (?, ?, ?)",
                     (recipient, frontier.hop_count, json.dumps(frontier.trail)))
    return outcomes


def get_frontier(conn: sqlite3.Connection, agent_id: str) -> Frontier | None:
    row = conn.execute("SELECT hop_count, trail FROM frontiers WHERE agent_id = ?", (agent_id,)).fetchone()
    return None if row is None else Frontier(row[0], tuple(json.loads(row[1])))


# -- reads --------------------------------------------------------------------
def get_message_by_sender(conn: sqlite3.Connection, sender: str, message_id: str) -> MessageRecord | None:
    row = conn.execute(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE sender = ? AND message_id = ?",
                       (sender, message_id)).fetchone()
    return message_of(row) if row else None


def get_message_by_inbox(conn: sqlite3.Connection, recipient: str, sequence: int) -> MessageRecord | None:
    row = conn.execute(f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE recipient = ? AND seq = ?",
                       (recipient, sequence)).fetchone()
    return message_of(row) if row else None


def page_start(after_key: str) -> int:
    """The dead-letter id a page token names (0: the first page)."""
    try:
        return int(after_key or 0)
    except ValueError:
        raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason=Reason.BAD_PAGE_TOKEN) from None


def list_dead_letters(conn: sqlite3.Connection, *, recipient: str, sender: str, after_id: int,
                      limit: int) -> tuple[list[MessageRecord], str]:
    column, value = ("sender", sender) if sender else ("recipient", recipient)
    columns = ", ".join("m." + c.strip() for c in MESSAGE_COLUMNS.split(","))
    rows = conn.execute(
        f"SELECT d.id, {columns} FROM dead_letters d JOIN messages m ON m.recipient = d.recipient"
        f" AND m.seq = d.seq WHERE d.{column} = ? AND d.id > ? ORDER BY d.id LIMIT ?",
        (value, after_id, limit)).fetchall()
    return [message_of(r[1:]) for r in rows], (str(rows[-1][0]) if len(rows) == limit else "")
