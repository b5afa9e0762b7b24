"""Schema of the SQLite store. Bump SCHEMA_VERSION with any change."""

SCHEMA_VERSION = 4
UPGRADABLE = {2, 3}
"""Versions that SCHEMA upgrades in place (it only adds tables)."""

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
CREATE TABLE IF NOT EXISTS conversations (
    conversation_id TEXT PRIMARY KEY,
    messages INTEGER NOT NULL
) WITHOUT ROWID;
"""
