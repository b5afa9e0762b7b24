"""The IOA outbox on SQLite: one row an entry, numbered in the order added (base.OutboxStore)."""

from __future__ import annotations

import sqlite3

from inboxmesh.common.v1 import envelope_pb2
from services.store.base import EventRow, OutboxAdded, OutboxEntry


def add(conn: sqlite3.Connection, rows: list[EventRow], entries: list[OutboxEntry], limit: int) -> list[OutboxAdded]:
    """(In the writer's transaction: adds of one message id at once are one after the other.)"""
    held = conn.execute("SELECT count(*) FROM outbox").fetchone()[0]
    added = []
    for entry in entries:
        found = conn.execute("SELECT number FROM outbox WHERE sender = ? AND message_id = ?",
                             (entry.sender, entry.envelope.message_id)).fetchone()
        if found is not None:
            added.append(OutboxAdded(int(found[0]), new=False))
        elif held >= limit:
            added.append(OutboxAdded(0, new=False))
        else:
            made = conn.execute(
                "INSERT INTO outbox (sender, message_id, envelope, expires_at_us, added_at_us) VALUES (?, ?, ?, ?, ?)",
                (entry.sender, entry.envelope.message_id, entry.envelope.SerializeToString(), entry.expires_at_us,
                 entry.added_at_us))
            added.append(OutboxAdded(int(made.lastrowid or 0), new=True))
            held += 1
    return added


def entries(conn: sqlite3.Connection, after: int, limit: int) -> list[OutboxEntry]:
    return [OutboxEntry(number, sender, envelope_pb2.Envelope.FromString(envelope), expires, added)
            for number, sender, envelope, expires, added in conn.execute(
                "SELECT number, sender, envelope, expires_at_us, added_at_us FROM outbox WHERE number > ?"
                " ORDER BY number LIMIT ?", (after, limit))]


def remove(conn: sqlite3.Connection, rows: list[EventRow], numbers: list[int]) -> None:
    conn.executemany("DELETE FROM outbox WHERE number = ?", [(n,) for n in numbers])
