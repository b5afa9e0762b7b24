"""The embedded default store: one SQLite file in WAL mode, durable commits.

Writes go through one writer connection with group commit
(services.store.sqlite_runner); reads use a second connection. Every check
that must be atomic (duplicates, capacity, open/closed, the one winning ack)
runs inside the writer's transaction, so several processes may share the
file: SQLite's lock serialises their writers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from services import errors
from services.config import StoreConfig
from services.store import base
from services.store.base import (
    ACCEPTED,
    AGENT_CLOSED,
    AGENT_OPEN,
    CONSUMED,
    DEAD_LETTERED,
    DELIVERED,
    DUPLICATE,
    INBOX_FULL,
    NOT_PERMITTED,
    QUEUED,
    TARGET_CLOSED,
    AckOutcome,
    AgentRecord,
    AppendItem,
    CloseOutcome,
    DeliveryBatch,
    EventQuery,
    MessageRecord,
    SendOutcome,
)
from services.store.sqlite_runner import Writer, connect
from services.store.sqlite_schema import SCHEMA, SCHEMA_VERSION
from services.telemetry import trace_id_of

log = logging.getLogger(__name__)
T = TypeVar("T")

_AGENT_COLUMNS = (
    "agent_id, name, mode, parent_id, scope_id, depth, state, metadata, inbox_capacity,"
    " created_at_us, credential_hash, closed_at_us, close_reason"
)
_MESSAGE_COLUMNS = (
    "envelope, state, attempts, stored_at_us, delivered_at_us, consumed_at_us, dead_at_us, dead_reason"
)
_INSERT_EVENT = (
    "INSERT INTO events (at_us, kind, agent_id, message_id, sender, recipient, seq, detail, trace_id)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_RECEIPT_NAME = {
    value: inbox_pb2.ReceiptStatus.Name(value).removeprefix("RECEIPT_STATUS_").lower()
    for value in inbox_pb2.ReceiptStatus.values()
}


def _agent(row: tuple) -> AgentRecord:
    return AgentRecord(
        agent_id=row[0],
        name=row[1],
        mode=row[2],
        parent_id=row[3],
        scope_id=row[4],
        depth=row[5],
        state=row[6],
        metadata=json.loads(row[7]),
        inbox_capacity=row[8],
        created_at_us=row[9],
        credential_hash=row[10],
        closed_at_us=row[11],
        close_reason=row[12],
    )


def _message(row: tuple) -> MessageRecord:
    envelope = envelope_pb2.Envelope.FromString(row[0])
    envelope.delivery_attempt = row[2]
    return MessageRecord(
        envelope=envelope,
        state=row[1],
        attempts=row[2],
        stored_at_us=row[3],
        delivered_at_us=row[4],
        consumed_at_us=row[5],
        dead_at_us=row[6],
        dead_reason=row[7],
    )


def _event(row: tuple) -> ev.Event:
    return ev.Event(
        event_id=row[0],
        at_us=row[1],
        kind=row[2],
        agent_id=row[3],
        message_id=row[4],
        sender=row[5],
        recipient=row[6],
        sequence=row[7],
        detail=row[8],
        trace_id=row[9],
    )


class _Inbox:
    """The counters of one recipient, loaded once per operation."""

    __slots__ = ("agent_id", "state", "capacity", "unconsumed", "next_seq", "dirty")

    def __init__(self, agent_id: str, row: tuple):
        self.agent_id = agent_id
        self.state, self.capacity, self.unconsumed, self.next_seq = row
        self.dirty = False


def _load_inbox(conn: sqlite3.Connection, agent_id: str) -> _Inbox | None:
    row = conn.execute(
        "SELECT state, inbox_capacity, unconsumed, next_seq FROM agents WHERE agent_id = ?", (agent_id,)
    ).fetchone()
    return _Inbox(agent_id, row) if row else None


def _dead_letter(
    conn: sqlite3.Connection, rows: list[tuple], reason: str, at_us: int, events: list[tuple]
) -> list[MessageRecord]:
    """Dead-letter messages given as (recipient, seq, sender, message_id, traceparent, MessageRecord)."""
    dead = []
    for recipient, seq, sender, message_id, traceparent, record in rows:
        trace_id = trace_id_of(traceparent)
        conn.execute(
            "UPDATE messages SET state = ?, dead_at_us = ?, dead_reason = ? WHERE recipient = ? AND seq = ?",
            (DEAD_LETTERED, at_us, reason, recipient, seq),
        )
        conn.execute(
            "INSERT INTO dead_letters (recipient, seq, sender) VALUES (?, ?, ?)", (recipient, seq, sender)
        )
        events.append(
            (at_us, ev.EVENT_KIND_MESSAGE_DEAD_LETTERED, recipient, message_id, sender, recipient, seq, reason,
             trace_id)
        )
        dead.append(
            MessageRecord(
                envelope=record.envelope,
                state=DEAD_LETTERED,
                attempts=record.attempts,
                stored_at_us=record.stored_at_us,
                delivered_at_us=record.delivered_at_us,
                dead_at_us=at_us,
                dead_reason=reason,
            )
        )
    return dead


class SqliteStore(base.Store):
    def __init__(self, config: StoreConfig):
        self.config = config
        self.path = Path(config.path)
        self._writer: Writer | None = None
        self._conn: sqlite3.Connection | None = None
        self._listeners: list = []

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = connect(self.path, synchronous=self.config.synchronous, busy_timeout_ms=self.config.busy_timeout_ms)
        try:
            conn.executescript(SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) != SCHEMA_VERSION:
                raise errors.FailedPrecondition(
                    f"{self.path} has schema version {row[0]}, this mesh needs {SCHEMA_VERSION}",
                    reason="SCHEMA_MISMATCH",
                )
        except BaseException:
            conn.close()
            raise
        self._writer = Writer(
            conn, max_pending=self.config.max_pending_writes, max_ops_per_commit=self.config.max_ops_per_commit,
            insert_events=_INSERT_EVENT,
        )
        self._writer.after_commit = self._after_commit
        self._writer.start()
        self._conn = conn
        log.info("sqlite store open at %s (synchronous=%s)", self.path, self.config.synchronous)

    def _after_commit(self, first_event_id: int, events: list[tuple]) -> None:
        for callback in self._listeners:
            try:
                callback(first_event_id, events)
            except Exception:  # a listener's bug must not stop the writer
                log.exception("commit listener failed")

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            await writer.close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def writer(self) -> Writer:
        if self._writer is None:
            raise errors.Unavailable("the store is not running", reason="STORE_CLOSED")
        return self._writer

    async def _read(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read on the connection. Reads are short indexed queries;
        outside a flush no transaction is open, so they see every commit."""
        if self._conn is None or self._writer is None:
            raise errors.Unavailable("the store is not running", reason="STORE_CLOSED")
        return op(self._conn)

    # -- registry -----------------------------------------------------------
    async def create_agent(self, record: AgentRecord) -> AgentRecord:
        def op(conn: sqlite3.Connection, events: list[tuple]) -> AgentRecord:
            if record.parent_id:
                parent = conn.execute(
                    "SELECT state FROM agents WHERE agent_id = ?", (record.parent_id,)
                ).fetchone()
                if parent is None:
                    raise errors.NotFound(f"parent agent {record.parent_id} does not exist", reason="AGENT_NOT_FOUND")
                if parent[0] != AGENT_OPEN:
                    raise errors.FailedPrecondition(
                        f"parent agent {record.parent_id} is closed; it cannot have new children",
                        reason="AGENT_CLOSED",
                    )
            conn.execute(
                f"INSERT INTO agents ({_AGENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.agent_id, record.name, record.mode, record.parent_id, record.scope_id, record.depth,
                    record.state, json.dumps(record.metadata, sort_keys=True), record.inbox_capacity,
                    record.created_at_us, record.credential_hash, record.closed_at_us, record.close_reason,
                ),
            )
            events.append(
                (record.created_at_us, ev.EVENT_KIND_AGENT_REGISTERED, record.agent_id, "", record.parent_id, "", 0,
                 f"name={record.name} mode={record.mode} scope={record.scope_id}", "")
            )
            return record

        return await self.writer.run(op)

    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        def op(conn: sqlite3.Connection) -> AgentRecord | None:
            row = conn.execute(f"SELECT {_AGENT_COLUMNS} FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
            return _agent(row) if row else None

        return await self._read(op)

    async def find_agents(self, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]:
        def op(conn: sqlite3.Connection) -> list[AgentRecord]:
            rows = conn.execute(
                f"SELECT {_AGENT_COLUMNS} FROM agents WHERE scope_id = ? AND name = ?"
                + ("" if include_closed else f" AND state = {AGENT_OPEN}")
                + " ORDER BY row",
                (scope_id, name),
            ).fetchall()
            return [_agent(r) for r in rows]

        return await self._read(op)

    async def list_agents(
        self, *, scope_id: str = "", parent_id: str = "", include_closed: bool, after_key: str, limit: int
    ) -> list[AgentRecord]:
        column, value = ("parent_id", parent_id) if parent_id else ("scope_id", scope_id)

        def op(conn: sqlite3.Connection) -> list[AgentRecord]:
            after_row = 0
            if after_key:
                found = conn.execute("SELECT row FROM agents WHERE agent_id = ?", (after_key,)).fetchone()
                if found is None:
                    raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason="BAD_PAGE_TOKEN")
                after_row = found[0]
            rows = conn.execute(
                f"SELECT {_AGENT_COLUMNS} FROM agents WHERE {column} = ? AND row > ?"
                + ("" if include_closed else f" AND state = {AGENT_OPEN}")
                + " ORDER BY row LIMIT ?",
                (value, after_row, limit),
            ).fetchall()
            return [_agent(r) for r in rows]

        return await self._read(op)

    async def close_agent(self, agent_id: str, reason: str, at_us: int) -> CloseOutcome:
        def op(conn: sqlite3.Connection, events: list[tuple]) -> CloseOutcome:
            rows = conn.execute(
                f"""WITH RECURSIVE tree(id, level) AS (
                        SELECT agent_id, 0 FROM agents WHERE agent_id = ?
                        UNION ALL
                        SELECT a.agent_id, tree.level + 1 FROM agents a JOIN tree ON a.parent_id = tree.id
                    )
                    SELECT {_AGENT_COLUMNS} FROM agents JOIN tree ON agents.agent_id = tree.id
                    WHERE agents.state = {AGENT_OPEN} ORDER BY tree.level, agents.row""",
                (agent_id,),
            ).fetchall()
            closed, dead = [], []
            for row in rows:
                agent = _agent(row)
                detail = reason if agent.agent_id == agent_id else f"ancestor {agent_id} closed: {reason}"
                conn.execute(
                    "UPDATE agents SET state = ?, closed_at_us = ?, close_reason = ?, unconsumed = 0"
                    " WHERE agent_id = ?",
                    (AGENT_CLOSED, at_us, detail, agent.agent_id),
                )
                events.append((at_us, ev.EVENT_KIND_AGENT_CLOSED, agent.agent_id, "", "", "", 0, detail, ""))
                queued = conn.execute(
                    f"SELECT recipient, seq, sender, message_id, traceparent, {_MESSAGE_COLUMNS} FROM messages"
                    " WHERE recipient = ? AND state IN (1, 2) ORDER BY seq",
                    (agent.agent_id,),
                ).fetchall()
                dead += _dead_letter(conn, [(*r[:5], _message(r[5:])) for r in queued], base.REASON_CLOSED, at_us,
                                     events)
                closed.append(replace(agent, state=AGENT_CLOSED, closed_at_us=at_us, close_reason=detail))
            return CloseOutcome(closed=closed, dead_lettered=dead)

        return await self.writer.run(op)

    # -- inbox --------------------------------------------------------------
    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        def op(conn: sqlite3.Connection, events: list[tuple]) -> list[SendOutcome]:
            sender_row = conn.execute("SELECT state FROM agents WHERE agent_id = ?", (sender_id,)).fetchone()
            sender_open = sender_row is not None and sender_row[0] == AGENT_OPEN
            inboxes: dict[str, _Inbox | None] = {}
            outcomes: list[SendOutcome] = []
            for item in items:
                env = item.envelope
                mid, rid = env.message_id, env.recipient
                traceparent = env.trace.traceparent
                trace_id = trace_id_of(traceparent)
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
                        inboxes[rid] = _load_inbox(conn, rid)
                    inbox = inboxes[rid]
                    if inbox is None:
                        outcome = SendOutcome(mid, rid, base.UNKNOWN_TARGET, detail=f"no agent {rid}")
                    elif inbox.state != AGENT_OPEN:
                        outcome = SendOutcome(mid, rid, TARGET_CLOSED, detail=f"agent {rid} is closed")
                    elif inbox.unconsumed >= inbox.capacity:
                        outcome = SendOutcome(
                            mid, rid, INBOX_FULL,
                            detail=f"agent {rid} holds {inbox.unconsumed} unconsumed messages (capacity"
                                   f" {inbox.capacity}); nothing was evicted, retry after it consumes",
                        )
                    else:
                        seq = inbox.next_seq
                        inbox.next_seq += 1
                        inbox.unconsumed += 1
                        inbox.dirty = True
                        env.sequence = seq
                        env.stored_at_us = at_us
                        env.delivery_attempt = 0
                        conn.execute(
                            "INSERT INTO messages (recipient, seq, sender, message_id, state, envelope, traceparent,"
                            " stored_at_us, expires_at_us) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (rid, seq, sender_id, mid, QUEUED, env.SerializeToString(), traceparent, at_us,
                             env.expires_at_us),
                        )
                        outcome = SendOutcome(mid, rid, ACCEPTED, seq, at_us, envelope=env)
                events.append(
                    (at_us, ev.EVENT_KIND_MESSAGE_SENT, outcome.recipient, mid, sender_id, outcome.recipient,
                     outcome.sequence, _RECEIPT_NAME[outcome.status], trace_id)
                )
                if outcome.status == ACCEPTED:
                    events.append(
                        (at_us, ev.EVENT_KIND_MESSAGE_STORED, rid, mid, sender_id, rid, outcome.sequence, "",
                         trace_id)
                    )
                outcomes.append(outcome)
            for inbox in inboxes.values():
                if inbox is not None and inbox.dirty:
                    conn.execute(
                        "UPDATE agents SET next_seq = ?, unconsumed = ? WHERE agent_id = ?",
                        (inbox.next_seq, inbox.unconsumed, inbox.agent_id),
                    )
            return outcomes

        return await self.writer.run(op)

    async def next_deliveries(
        self, recipient: str, after_sequence: int, limit: int, max_attempts: int, now_us: int
    ) -> DeliveryBatch:
        def op(conn: sqlite3.Connection, events: list[tuple]) -> DeliveryBatch:
            state = conn.execute("SELECT state FROM agents WHERE agent_id = ?", (recipient,)).fetchone()
            if state is None or state[0] != AGENT_OPEN:
                return DeliveryBatch([], [], recipient_open=False)
            rows = conn.execute(
                f"SELECT recipient, seq, sender, message_id, traceparent, expires_at_us, {_MESSAGE_COLUMNS}"
                " FROM messages WHERE recipient = ? AND seq > ? AND state IN (1, 2) ORDER BY seq LIMIT ?",
                (recipient, after_sequence, limit),
            ).fetchall()
            deliver, expired, exhausted = [], [], []
            for row in rows:
                key, expires_at, record = row[:5], row[5], _message(row[6:])
                if expires_at and expires_at <= now_us:
                    expired.append((*key, record))
                elif record.attempts >= max_attempts:
                    exhausted.append((*key, record))
                else:
                    deliver.append((key, record))
            dead = _dead_letter(conn, expired, base.REASON_EXPIRED, now_us, events)
            dead += _dead_letter(conn, exhausted, base.REASON_ATTEMPTS, now_us, events)
            if dead:
                conn.execute(
                    "UPDATE agents SET unconsumed = unconsumed - ? WHERE agent_id = ?", (len(dead), recipient)
                )
            envelopes = []
            for (rid, seq, sender, mid, traceparent), record in deliver:
                trace_id = trace_id_of(traceparent)
                attempt = record.attempts + 1
                conn.execute(
                    "UPDATE messages SET state = ?, attempts = ?,"
                    " delivered_at_us = CASE delivered_at_us WHEN 0 THEN ? ELSE delivered_at_us END"
                    " WHERE recipient = ? AND seq = ?",
                    (DELIVERED, attempt, now_us, rid, seq),
                )
                events.append(
                    (now_us, ev.EVENT_KIND_MESSAGE_DELIVERED, rid, mid, sender, rid, seq, f"attempt={attempt}",
                     trace_id)
                )
                record.envelope.delivery_attempt = attempt
                envelopes.append(record.envelope)
            return DeliveryBatch(envelopes, dead, recipient_open=True)

        return await self.writer.run(op)

    async def mark_delivered(
        self, recipient: str, envelopes: list[envelope_pb2.Envelope], at_us: int
    ) -> asyncio.Future:
        keys = [(e.sequence, e.message_id, e.sender, trace_id_of(e.trace.traceparent)) for e in envelopes]

        def op(conn: sqlite3.Connection, events: list[tuple]) -> None:
            for seq, mid, sender, trace_id in keys:
                cur = conn.execute(
                    "UPDATE messages SET state = ?, attempts = 1, delivered_at_us = ?"
                    " WHERE recipient = ? AND seq = ? AND state = ?",
                    (DELIVERED, at_us, recipient, seq, QUEUED),
                )
                if cur.rowcount:
                    events.append(
                        (at_us, ev.EVENT_KIND_MESSAGE_DELIVERED, recipient, mid, sender, recipient, seq,
                         "attempt=1", trace_id)
                    )

        return await self.writer.enqueue(op, lazy=True)

    async def ack(self, recipient: str, sequences: list[int], at_us: int) -> list[AckOutcome]:
        def op(conn: sqlite3.Connection, events: list[tuple]) -> list[AckOutcome]:
            outcomes = []
            consumed = 0
            for seq in sequences:
                row = conn.execute(
                    "SELECT state, message_id, sender, traceparent FROM messages WHERE recipient = ? AND seq = ?",
                    (recipient, seq),
                ).fetchone()
                if row is None:
                    outcomes.append(AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND))
                    continue
                state, mid, sender, traceparent = row
                if state == CONSUMED:
                    outcomes.append(AckOutcome(seq, mid, inbox_pb2.ACK_STATUS_ALREADY_CONSUMED))
                elif state == DEAD_LETTERED:
                    outcomes.append(AckOutcome(seq, mid, inbox_pb2.ACK_STATUS_DEAD_LETTERED))
                else:
                    conn.execute(
                        "UPDATE messages SET state = ?, consumed_at_us = ? WHERE recipient = ? AND seq = ?",
                        (CONSUMED, at_us, recipient, seq),
                    )
                    consumed += 1
                    events.append(
                        (at_us, ev.EVENT_KIND_MESSAGE_CONSUMED, recipient, mid, sender, recipient, seq, "",
                         trace_id_of(traceparent))
                    )
                    outcomes.append(AckOutcome(seq, mid, inbox_pb2.ACK_STATUS_CONSUMED, traceparent))
            if consumed:
                conn.execute(
                    "UPDATE agents SET unconsumed = unconsumed - ? WHERE agent_id = ?", (consumed, recipient)
                )
            return outcomes

        return await self.writer.run(op)

    async def get_message_by_sender(self, sender: str, message_id: str) -> MessageRecord | None:
        def op(conn: sqlite3.Connection) -> MessageRecord | None:
            row = conn.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE sender = ? AND message_id = ?", (sender, message_id)
            ).fetchone()
            return _message(row) if row else None

        return await self._read(op)

    async def get_message_by_inbox(self, recipient: str, sequence: int) -> MessageRecord | None:
        def op(conn: sqlite3.Connection) -> MessageRecord | None:
            row = conn.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE recipient = ? AND seq = ?", (recipient, sequence)
            ).fetchone()
            return _message(row) if row else None

        return await self._read(op)

    async def list_dead_letters(
        self, *, recipient: str = "", sender: str = "", after_key: str, limit: int
    ) -> tuple[list[MessageRecord], str]:
        column, value = ("sender", sender) if sender else ("recipient", recipient)
        try:
            after_id = int(after_key or 0)
        except ValueError:
            raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason="BAD_PAGE_TOKEN") from None

        def op(conn: sqlite3.Connection) -> tuple[list[MessageRecord], str]:
            rows = conn.execute(
                f"SELECT d.id, {', '.join('m.' + c.strip() for c in _MESSAGE_COLUMNS.split(','))}"
                f" FROM dead_letters d JOIN messages m ON m.recipient = d.recipient AND m.seq = d.seq"
                f" WHERE d.{column} = ? AND d.id > ? ORDER BY d.id LIMIT ?",
                (value, after_id, limit),
            ).fetchall()
            page = [_message(r[1:]) for r in rows]
            next_key = str(rows[-1][0]) if len(rows) == limit else ""
            return page, next_key

        return await self._read(op)

    # -- events -------------------------------------------------------------
    async def list_events(self, query: EventQuery) -> list[ev.Event]:
        where, params = ["event_id > ?"], [query.after_event_id]
        if query.message_id:
            where.append("message_id = ?")
            params.append(query.message_id)
        if query.sender:
            where.append("sender = ?")
            params.append(query.sender)
        if query.agent_id:
            where.append("(agent_id = ? OR sender = ?)")
            params += [query.agent_id, query.agent_id]
        if query.kinds:
            where.append(f"kind IN ({', '.join('?' * len(query.kinds))})")
            params += list(query.kinds)
        sql = f"SELECT * FROM events WHERE {' AND '.join(where)} ORDER BY event_id LIMIT ?"
        params.append(query.limit)

        def op(conn: sqlite3.Connection) -> list[ev.Event]:
            return [_event(r) for r in conn.execute(sql, params).fetchall()]

        return await self._read(op)

    async def record_events(self, events: list[ev.Event]) -> None:
        rows = [
            (e.at_us, e.kind, e.agent_id, e.message_id, e.sender, e.recipient, e.sequence, e.detail, e.trace_id)
            for e in events
        ]
        await self.writer.enqueue(lambda conn, events: events.extend(rows), lazy=True)

    def add_commit_listener(self, callback) -> None:
        self._listeners.append(callback)

    async def last_event_id(self) -> int:
        def op(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT max(event_id) FROM events").fetchone()
            return row[0] or 0

        return await self._read(op)
