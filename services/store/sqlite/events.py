"""The event record on SQLite: the events table, read by filter; rows are written by the writer with the
operation that caused them (services.store.sqlite.writer)."""

from __future__ import annotations

import sqlite3

from services.store.base import EventQuery, EventRecord, EventRow
from services.store.sqlite.schema import EVENT_COLUMNS


def list_events(conn: sqlite3.Connection, query: EventQuery) -> list[EventRecord]:
    where: list[str] = ["event_id > ?"]
    params: list[object] = [query.after_event_id]
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
    sql = f"SELECT event_id, {EVENT_COLUMNS} FROM events WHERE {' AND '.join(where)} ORDER BY event_id LIMIT ?"
    params.append(query.limit)
    return [EventRow(*r[1:]).event(r[0]) for r in conn.execute(sql, params).fetchall()]


def last_event_id(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT max(event_id) FROM events").fetchone()[0] or 0)
