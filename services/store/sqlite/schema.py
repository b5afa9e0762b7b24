"""Schema of the SQLite store, and how its rows read back as records. Bump SCHEMA_VERSION with any
change."""

from __future__ import annotations

import json
import sqlite3

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from services.store.base import EVENT_ROW_FIELDS, AgentRecord, MessageRecord

SCHEMA_VERSION = 7
UPGRADABLE = {2, 3, 4, 5, 6}
"""Versions that SCHEMA upgrades in place (it only adds tables, indexes and triggers; UPGRADE fills
what they derive from rows written before)."""
CLOSED_KIND = ev.EVENT_KIND_AGENT_CLOSED

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);

CREATE TABLE IF NOT EXISTS agents (
    row INTEGER PRIMARY KEY,
    agent_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    mode INTEGER NOT NULL,
    parent_id TEXT NOT NULL,
    scope_id TEXT NOT NULL,
    depth INTEGER NOT NULL,
    state INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    inbox_capacity INTEGER NOT NULL,
    created_at_us INTEGER NOT NULL,
    credential_hash BLOB NOT NULL,
    closed_at_us INTEGER NOT NULL DEFAULT 0,
    close_reason TEXT NOT NULL DEFAULT '',
    next_seq INTEGER NOT NULL DEFAULT 1,
    unconsumed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS agents_by_scope_name ON agents(scope_id, name);
CREATE INDEX IF NOT EXISTS agents_by_parent ON agents(parent_id);

-- state: 1 queued, 2 delivered, 3 consumed, 4 dead-lettered (MessageState).
CREATE TABLE IF NOT EXISTS messages (
    recipient TEXT NOT NULL,
    seq INTEGER NOT NULL,
    sender TEXT NOT NULL,
    message_id TEXT NOT NULL,
    state INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    envelope BLOB NOT NULL,
    traceparent TEXT NOT NULL DEFAULT '',
    stored_at_us INTEGER NOT NULL,
    expires_at_us INTEGER NOT NULL DEFAULT 0,
    delivered_at_us INTEGER NOT NULL DEFAULT 0,
    consumed_at_us INTEGER NOT NULL DEFAULT 0,
    dead_at_us INTEGER NOT NULL DEFAULT 0,
    dead_reason TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (recipient, seq)
) WITHOUT ROWID;
CREATE UNIQUE INDEX IF NOT EXISTS messages_by_sender ON messages(sender, message_id);
CREATE INDEX IF NOT EXISTS messages_unconsumed ON messages(recipient, seq) WHERE state IN (1, 2);

CREATE TABLE IF NOT EXISTS dead_letters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    recipient TEXT NOT NULL,
    seq INTEGER NOT NULL,
    sender TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS dead_letters_by_recipient ON dead_letters(recipient, id);
CREATE INDEX IF NOT EXISTS dead_letters_by_sender ON dead_letters(sender, id);

CREATE TABLE IF NOT EXISTS events (
    event_id INTEGER PRIMARY KEY AUTOINCREMENT,
    at_us INTEGER NOT NULL,
    kind INTEGER NOT NULL,
    agent_id TEXT NOT NULL,
    message_id TEXT NOT NULL,
    sender TEXT NOT NULL,
    recipient TEXT NOT NULL,
    seq INTEGER NOT NULL,
    detail TEXT NOT NULL,
    trace_id TEXT NOT NULL,
    turn INTEGER NOT NULL DEFAULT 0,
    in_reply_to TEXT NOT NULL DEFAULT '',
    conversation_id TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_by_agent ON events(agent_id, event_id);
CREATE INDEX IF NOT EXISTS events_by_sender ON events(sender, event_id);
CREATE INDEX IF NOT EXISTS events_by_message ON events(message_id);

-- Subagent runs: the record is an inboxmesh.runs.v1.SubagentRun; the other
-- columns index it. active: not ended. settled: announce stored or the
-- requester gone. cleaned: cleanup done.
CREATE TABLE IF NOT EXISTS runs (
    row INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL UNIQUE,
    child_id TEXT NOT NULL UNIQUE,
    requester_id TEXT NOT NULL,
    active INTEGER NOT NULL,
    started INTEGER NOT NULL DEFAULT 0,
    announce_state INTEGER NOT NULL,
    cleaned INTEGER NOT NULL DEFAULT 0,
    deadline_us INTEGER NOT NULL DEFAULT 0,
    archive_at_us INTEGER NOT NULL DEFAULT 0,
    archived INTEGER NOT NULL DEFAULT 0,
    record BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_by_requester ON runs(requester_id, row);
CREATE INDEX IF NOT EXISTS runs_active ON runs(requester_id) WHERE active = 1;
CREATE INDEX IF NOT EXISTS runs_unfinished ON runs(row) WHERE archived = 0;

-- Running children per requester, kept by the triggers below: a spawn checks its parent's limit with
-- one row read instead of counting every running child (at 10,000 children that count took 1 ms, more
-- than the spawn's commit).
CREATE TABLE IF NOT EXISTS active_children (
    requester_id TEXT PRIMARY KEY,
    n INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS runs_active_added AFTER INSERT ON runs WHEN NEW.active = 1 BEGIN
    INSERT INTO active_children (requester_id, n) VALUES (NEW.requester_id, 1)
        ON CONFLICT(requester_id) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS runs_active_changed AFTER UPDATE OF active ON runs
        WHEN OLD.active != NEW.active BEGIN
    INSERT INTO active_children (requester_id, n) VALUES (NEW.requester_id, NEW.active)
        ON CONFLICT(requester_id) DO UPDATE SET n = n + CASE NEW.active WHEN 1 THEN 1 ELSE -1 END;
END;
CREATE TRIGGER IF NOT EXISTS runs_active_removed AFTER DELETE ON runs WHEN OLD.active = 1 BEGIN
    UPDATE active_children SET n = n - 1 WHERE requester_id = OLD.requester_id;
END;

-- Routing sessions: one agent per session key.
CREATE TABLE IF NOT EXISTS sessions (
    session_key TEXT PRIMARY KEY,
    agent_id TEXT NOT NULL
) WITHOUT ROWID;

-- Loop guard: per agent, the hop count and trail of the causal chain it last
-- consumed from (its sends continue that chain). trail: JSON list of ids.
CREATE TABLE IF NOT EXISTS frontiers (
    agent_id TEXT PRIMARY KEY,
    hop_count INTEGER NOT NULL,
    trail TEXT NOT NULL
) WITHOUT ROWID;

-- Loop guard: messages stored per conversation.
-- The IOA outbox (services.ioa.relay): messages to IOA agents kept until the far side is reachable.
CREATE TABLE IF NOT EXISTS outbox (
    number INTEGER PRIMARY KEY AUTOINCREMENT,
    sender TEXT NOT NULL,
    message_id TEXT NOT NULL,
    envelope BLOB NOT NULL,
    expires_at_us INTEGER NOT NULL,
    added_at_us INTEGER NOT NULL,
    UNIQUE (sender, message_id)
);

CREATE TABLE IF NOT EXISTS conversations (
    conversation_id TEXT PRIMARY KEY,
    messages INTEGER NOT NULL
) WITHOUT ROWID;
""" + f"""
-- Closes in commit order (delivery streams follow closes made by other processes: agents.closes_since).
CREATE INDEX IF NOT EXISTS events_closes ON events(event_id) WHERE kind = {CLOSED_KIND};
"""

UPGRADE = """
DELETE FROM active_children;
INSERT INTO active_children (requester_id, n) SELECT requester_id, count(*) FROM runs WHERE active = 1
    GROUP BY requester_id;
"""
"""Run once when a file of an UPGRADABLE version is opened (after SCHEMA): fills what the new tables
derive from the rows written before them."""

AGENT_COLUMNS = (
    "agent_id, name, mode, parent_id, scope_id, depth, state, metadata, inbox_capacity,"
    " created_at_us, credential_hash, closed_at_us, close_reason"
)
MESSAGE_COLUMNS = (
    "envelope, state, attempts, stored_at_us, delivered_at_us, consumed_at_us, dead_at_us, dead_reason"
)
EVENT_COLUMNS = ", ".join(EVENT_ROW_FIELDS)
INSERT_EVENT = f"INSERT INTO events ({EVENT_COLUMNS}) VALUES ({', '.join('?' * len(EVENT_ROW_FIELDS))})"


def agent_of(row: tuple) -> AgentRecord:
    """The record of an agents row read with AGENT_COLUMNS."""
    return AgentRecord(
        agent_id=row[0], name=row[1], mode=row[2], parent_id=row[3], scope_id=row[4], depth=row[5], state=row[6],
        metadata=json.loads(row[7]), inbox_capacity=row[8], created_at_us=row[9], credential_hash=row[10],
        closed_at_us=row[11], close_reason=row[12],
    )


def message_of(row: tuple) -> MessageRecord:
    """The record of a messages row read with MESSAGE_COLUMNS."""
    envelope = envelope_pb2.Envelope.FromString(row[0])
    envelope.delivery_attempt = row[2]
    return MessageRecord(
        envelope=envelope, state=row[1], attempts=row[2], stored_at_us=row[3], delivered_at_us=row[4],
        consumed_at_us=row[5], dead_at_us=row[6], dead_reason=row[7],
    )


def row_after(conn: sqlite3.Connection, table: str, key_column: str, page_token: str) -> int:
    """The row number a page token (the last key of the previous page) names;
    0 for the first page."""
    if not page_token:
        return 0
    found = conn.execute(f"SELECT row FROM {table} WHERE {key_column} = ?", (page_token,)).fetchone()
    if found is None:
        raise errors.InvalidArgument(f"page_token {page_token!r} is not valid", reason=Reason.BAD_PAGE_TOKEN)
    return int(found[0])
