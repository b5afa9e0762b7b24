"""Agents and scopes on SQLite: registration, look-ups, close (with the dead letters it causes),
credentials. Write operations run inside the writer's transaction (services.store.sqlite.writer) and
append the event rows they cause; reads run on the connection between commits."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from services.store import base
from services.store.base import AGENT_CLOSED, AGENT_OPEN, AgentRecord, CloseOutcome, Closes, EventRow, MessageRecord
from services.store.sqlite import inbox
from services.store.sqlite.schema import AGENT_COLUMNS, CLOSED_KIND, MESSAGE_COLUMNS, agent_of, message_of, row_after


# -- reads --------------------------------------------------------------------
def get_agent(conn: sqlite3.Connection, agent_id: str) -> AgentRecord | None:
    row = conn.execute(f"SELECT {AGENT_COLUMNS} FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
    return agent_of(row) if row else None


def find_agents(conn: sqlite3.Connection, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]:
    sql = (f"SELECT {AGENT_COLUMNS} FROM agents WHERE scope_id = ? AND name = ?"
           + ("" if include_closed else f" AND state = {AGENT_OPEN}") + " ORDER BY row")
    return [agent_of(r) for r in conn.execute(sql, (scope_id, name)).fetchall()]


def list_agents(conn: sqlite3.Connection, *, scope_id: str, parent_id: str, include_closed: bool, after_key: str,
                limit: int) -> list[AgentRecord]:
    column, value = ("parent_id", parent_id) if parent_id else ("scope_id", scope_id)
    after_row = row_after(conn, "agents", "agent_id", after_key)
    rows = conn.execute(
        f"SELECT {AGENT_COLUMNS} FROM agents WHERE {column} = ? AND row > ?"
        + ("" if include_closed else f" AND state = {AGENT_OPEN}") + " ORDER BY row LIMIT ?",
        (value, after_row, limit)).fetchall()
    return [agent_of(r) for r in rows]


def closes_since(conn: sqlite3.Connection, cursor: int | None, limit: int) -> Closes:
    """Closes by any process sharing the file, from their events (written in the close's transaction;
    SQLite has one writer at a time, so event ids follow commit order). The cursor is an event id; the
    partial index events_closes makes this a read of the closes alone."""
    if cursor is None:
        row = conn.execute(f"SELECT COALESCE(MAX(event_id), 0) FROM events WHERE kind = {CLOSED_KIND}").fetchone()
        return Closes([], int(row[0]))
    rows = conn.execute(
        f"SELECT event_id, agent_id, detail FROM events WHERE kind = {CLOSED_KIND} AND event_id > ?"
        " ORDER BY event_id LIMIT ?", (cursor, limit)).fetchall()
    return Closes([(r[1], r[2]) for r in rows], rows[-1][0] if rows else cursor, more=len(rows) >= limit)


# -- writes -------------------------------------------------------------------
def create_agent(conn: sqlite3.Connection, events: list[EventRow], record: AgentRecord) -> AgentRecord:
    if record.parent_id:
        parent = conn.execute("SELECT state FROM agents WHERE agent_id = ?", (record.parent_id,)).fetchone()
        if parent is None:
            raise errors.NotFound(f"parent agent {record.parent_id} does not exist", reason=Reason.AGENT_NOT_FOUND)
        if parent[0] != AGENT_OPEN:
            raise errors.FailedPrecondition(
                f"parent agent {record.parent_id} is closed; it cannot have new children", reason=Reason.AGENT_CLOSED)
    conn.execute(
        f"INSERT INTO agents ({AGENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (record.agent_id, record.name, record.mode, record.parent_id, record.scope_id, record.depth, record.state,
         json.dumps(record.metadata, sort_keys=True), record.inbox_capacity, record.created_at_us,
         record.credential_hash, record.closed_at_us, record.close_reason),
    )
    events.append(EventRow(record.created_at_us, ev.EVENT_KIND_AGENT_REGISTERED, record.agent_id,
                           sender=record.parent_id,
                           detail=f"name={record.name} mode={record.mode} scope={record.scope_id}"))
    return record


def close_agent(conn: sqlite3.Connection, events: list[EventRow], agent_id: str, reason: str,
                at_us: int) -> CloseOutcome:
    """Close the agent and its open descendants and dead-letter what they hold (the runs they leave are
    services.store.sqlite.runs.end_runs_of_closed's)."""
    rows = conn.execute(
        f"""WITH RECURSIVE tree(id, level) AS (
                SELECT agent_id, 0 FROM agents WHERE agent_id = ?
                UNION ALL
                SELECT a.agent_id, tree.level + 1 FROM agents a JOIN tree ON a.parent_id = tree.id
            )
            SELECT {AGENT_COLUMNS} FROM agents JOIN tree ON agents.agent_id = tree.id
            WHERE agents.state = {AGENT_OPEN} ORDER BY tree.level, agents.row""",
        (agent_id,),
    ).fetchall()
    closed: list[AgentRecord] = []
    queued: list[tuple[str, list[MessageRecord]]] = []
    for row in rows:
        agent = agent_of(row)
        detail = reason if agent.agent_id == agent_id else f"ancestor {agent_id} closed: {reason}"
        conn.execute(
            "UPDATE agents SET state = ?, closed_at_us = ?, close_reason = ? WHERE agent_id = ?",
            (AGENT_CLOSED, at_us, detail, agent.agent_id),
        )
        events.append(EventRow(at_us, ev.EVENT_KIND_AGENT_CLOSED, agent.agent_id, detail=detail))
        closed.append(replace(agent, state=AGENT_CLOSED, closed_at_us=at_us, close_reason=detail))
        records = [message_of(r) for r in conn.execute(
            f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE recipient = ? AND state IN (1, 2) ORDER BY seq",
            (agent.agent_id,)).fetchall()]
        queued.append((agent.agent_id, records))
    dead, notices = [], []
    for recipient, records in queued:
        found = inbox.dead_letter(conn, events, recipient, records, base.REASON_CLOSED, at_us)
        dead += found[0]
        notices += found[1]
    return CloseOutcome(closed=closed, dead_lettered=dead, notices=notices)


def set_credential(conn: sqlite3.Connection, events: list[EventRow], agent_id: str,
                   credential_hash: bytes) -> AgentRecord:
    cur = conn.execute("UPDATE agents SET credential_hash = ? WHERE agent_id = ? AND state = ?",
                       (credential_hash, agent_id, AGENT_OPEN))
    if not cur.rowcount:
        raise errors.FailedPrecondition(f"agent {agent_id} is closed or unknown; no credential issued",
                                        reason=Reason.AGENT_CLOSED, metadata={"agent_id": agent_id})
    found = get_agent(conn, agent_id)
    assert found is not None  # just updated, inside the same transaction
    return found
