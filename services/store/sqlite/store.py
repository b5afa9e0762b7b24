"""The embedded default store: one SQLite file in WAL mode, durable commits.

Writes are operations (one module per concern: agents, inbox, runs and
sessions, events) queued to a group-commit writer (writer.py); reads run on
the same connection between commits. Every check that must be atomic (duplicates, capacity,
open/closed, the one winning ack) runs inside the writer's transaction, so
several processes may share the file: SQLite's lock serialises their
writers.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2
from services.config import StoreConfig
from services.store import base
from services.store.base import (
    AckOutcome,
    AgentRecord,
    AnnounceOutcome,
    AppendItem,
    CloseOutcome,
    Closes,
    CommitListener,
    DeliveryBatch,
    EventQuery,
    EventRecord,
    EventRow,
    Frontier,
    MessageRecord,
    OutboxAdded,
    OutboxEntry,
    RunRecord,
    RunWork,
    SendOutcome,
    SpawnLimits,
)
from services.store.sqlite import agents, inbox, outbox, runs, sessions
from services.store.sqlite import events as event_table
from services.store.sqlite.schema import SCHEMA, SCHEMA_VERSION, UPGRADABLE, UPGRADE
from services.store.sqlite.writer import EventIds, Writer, connect

log = logging.getLogger(__name__)
T = TypeVar("T")


def _ack(conn: sqlite3.Connection, rows: list[EventRow], recipient: str, sequences: list[int], at_us: int,
         turn: int) -> list[AckOutcome]:
    """One ack inside the writer's transaction: the consumption, and the start of the run whose task it
    consumed."""
    outcomes = inbox.ack(conn, rows, recipient, sequences, at_us, turn)
    consumed = [o.message_id for o in outcomes if o.status == inbox_pb2.ACK_STATUS_CONSUMED]
    if consumed:
        runs.mark_started(conn, rows, recipient, consumed, at_us)
    return outcomes


class SqliteStore(base.Store):
    """Every concern's interface over one connection: writes queued to the writer, reads between
    commits. The SQL of each concern is in its module (agents, inbox, runs, events)."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.path = Path(config.path)
        self._writer: Writer | None = None
        self._conn: sqlite3.Connection | None = None
        self._listeners: list[CommitListener] = []

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = connect(self.path, synchronous=self.config.synchronous, busy_timeout_ms=self.config.busy_timeout_ms)
        try:
            conn.executescript(SCHEMA)
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) in UPGRADABLE:
                conn.executescript(f"BEGIN IMMEDIATE; {UPGRADE}"
                                   f" UPDATE meta SET value = '{SCHEMA_VERSION}' WHERE key = 'schema_version'; COMMIT;")
                log.info("upgraded %s from schema version %s to %d", self.path, row[0], SCHEMA_VERSION)
            elif int(row[0]) != SCHEMA_VERSION:
                raise errors.FailedPrecondition(
                    f"{self.path} has schema version {row[0]}, this mesh needs {SCHEMA_VERSION}; use another"
                    " --data-dir or remove the old file", reason=Reason.SCHEMA_MISMATCH)
        except BaseException:
            conn.close()
            raise
        self._writer = Writer(conn, max_pending=self.config.max_pending_writes,
                              max_ops_per_commit=self.config.max_ops_per_commit)
        self._writer.after_commit = self._after_commit
        self._writer.start()
        self._conn = conn
        log.info("sqlite store open at %s (synchronous=%s)", self.path, self.config.synchronous)

    def _after_commit(self, first_event_id: int, rows: list[EventRow]) -> None:
        for callback in self._listeners:
            try:
                callback(first_event_id, rows)
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
            raise errors.Unavailable("the store is not running", reason=Reason.STORE_CLOSED)
        return self._writer

    async def _read(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read on the connection. Reads are short indexed queries;
        outside a flush no transaction is open, so they see every commit."""
        if self._conn is None or self._writer is None:
            raise errors.Unavailable("the store is not running", reason=Reason.STORE_CLOSED)
        return op(self._conn)

    # -- agents (services.store.sqlite.agents) -----------------------------------
    async def create_agent(self, record: AgentRecord) -> AgentRecord:
        return await self.writer.run(lambda conn, rows: agents.create_agent(conn, rows, record))

    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        return await self._read(lambda conn: agents.get_agent(conn, agent_id))

    async def find_agents(self, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]:
        return await self._read(lambda conn: agents.find_agents(conn, scope_id, name, include_closed))

    async def list_agents(
        self, *, scope_id: str = "", parent_id: str = "", include_closed: bool, after_key: str, limit: int
    ) -> list[AgentRecord]:
        return await self._read(lambda conn: agents.list_agents(
            conn, scope_id=scope_id, parent_id=parent_id, include_closed=include_closed, after_key=after_key,
            limit=limit))

    async def close_agent(self, agent_id: str, reason: str, at_us: int) -> CloseOutcome:
        def op(conn: sqlite3.Connection, rows: list[EventRow]) -> CloseOutcome:
            outcome = agents.close_agent(conn, rows, agent_id, reason, at_us)
            runs.end_runs_of_closed(conn, rows, outcome.closed, at_us)
            return outcome

        return await self.writer.run(op)

    async def set_credential(self, agent_id: str, credential_hash: bytes) -> AgentRecord:
        return await self.writer.run(lambda conn, rows: agents.set_credential(conn, rows, agent_id, credential_hash))

    # -- runs and sessions (services.store.sqlite.runs, .sessions) ---------------------
    async def create_child(self, record: AgentRecord, run: RunRecord, limits: SpawnLimits, *,
                           resume: bool = False) -> AgentRecord:
        # one transaction: an agent that exists has its run, so `resume` never reaches here
        return await self.writer.run(lambda conn, rows: sessions.create_child(conn, rows, record, run, limits))

    async def get_run(self, *, run_id: str = "", child_id: str = "") -> RunRecord | None:
        return await self._read(lambda conn: runs.load(conn, run_id=run_id, child_id=child_id))

    async def list_runs(self, requester_id: str, include_archived: bool, after_key: str,
                        limit: int) -> list[RunRecord]:
        return await self._read(lambda conn: runs.list_runs(conn, requester_id, include_archived, after_key, limit))

    async def end_run(self, run_id: str, status: int, result: str, at_us: int,
                      traceparent: str = "") -> tuple[RunRecord, bool]:
        return await self.writer.run(lambda conn, rows: runs.end_run(conn, rows, run_id, status, result, at_us,
                                                                     traceparent))

    async def announce_run(self, run_id: str, at_us: int) -> AnnounceOutcome:
        return await self.writer.run(lambda conn, rows: runs.announce(conn, rows, run_id, at_us))

    async def finish_cleanup(self, run_id: str, detail: str, at_us: int) -> RunRecord:
        return await self.writer.run(lambda conn, rows: runs.finish_cleanup(conn, rows, run_id, detail, at_us))

    async def archive_run(self, run_id: str, at_us: int) -> RunRecord:
        return await self.writer.run(lambda conn, rows: runs.archive(conn, rows, run_id, at_us))

    async def run_work(self, now_us: int, limit: int) -> RunWork:
        return await self._read(lambda conn: runs.work(conn, now_us, limit))

    async def session_agent(self, session_key: str, new_agent: AgentRecord) -> tuple[AgentRecord, bool]:
        return await self.writer.run(lambda conn, rows: sessions.session_agent(conn, rows, session_key, new_agent))

    # -- inbox (services.store.sqlite.inbox) --------------------------------------------
    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        return await self.writer.run(lambda conn, rows: inbox.append(conn, rows, sender_id, items, at_us))

    async def append_groups(self, groups: list[tuple[str, list[AppendItem]]],
                            at_us: int) -> list[list[SendOutcome]]:
        # one operation: the groups are appended in order inside one transaction, all or (when one
        # raises) none
        return await self.writer.run(lambda conn, rows: [inbox.append(conn, rows, sender_id, items, at_us)
                                                         for sender_id, items in groups])

    async def next_deliveries(
        self, recipient: str, after_sequence: int, limit: int, max_attempts: int, now_us: int, in_flight: int = 0
    ) -> DeliveryBatch:
        # capacity is settled inside the append's transaction: whatever is stored may be delivered
        return await self.writer.run(lambda conn, rows: inbox.next_deliveries(
            conn, rows, recipient, after_sequence, limit, max_attempts, now_us))

    async def closes_since(self, cursor: int | None, limit: int) -> Closes:
        return await self._read(lambda conn: agents.closes_since(conn, cursor, limit))

    async def mark_delivered(
        self, recipient: str, envelopes: list[envelope_pb2.Envelope], at_us: int
    ) -> asyncio.Future[Any]:
        delivered = [inbox.delivered_row(recipient, e, 1, at_us) for e in envelopes]  # read now: the op runs later
        return await self.writer.enqueue(
            lambda conn, rows: inbox.mark_delivered(conn, rows, recipient, delivered, at_us), lazy=True)

    async def ack(self, recipient: str, sequences: list[int], at_us: int, turn: int = 0) -> list[AckOutcome]:
        return await self.writer.run(lambda conn, rows: _ack(conn, rows, recipient, sequences, at_us, turn))

    async def ack_many(self, entries: list[tuple[str, list[int], int]], at_us: int) -> list[list[AckOutcome]]:
        # one operation: every entry in order inside one transaction
        return await self.writer.run(lambda conn, rows: [_ack(conn, rows, recipient, sequences, at_us, turn)
                                                         for recipient, sequences, turn in entries])

    async def get_frontier(self, agent_id: str) -> Frontier | None:
        return await self._read(lambda conn: inbox.get_frontier(conn, agent_id))

    async def get_message_by_sender(self, sender: str, message_id: str) -> MessageRecord | None:
        return await self._read(lambda conn: inbox.get_message_by_sender(conn, sender, message_id))

    async def get_message_by_inbox(self, recipient: str, sequence: int) -> MessageRecord | None:
        return await self._read(lambda conn: inbox.get_message_by_inbox(conn, recipient, sequence))

    async def list_dead_letters(
        self, *, recipient: str = "", sender: str = "", after_key: str, limit: int
    ) -> tuple[list[MessageRecord], str]:
        after_id = inbox.page_start(after_key)
        return await self._read(lambda conn: inbox.list_dead_letters(
            conn, recipient=recipient, sender=sender, after_id=after_id, limit=limit))

    # -- the IOA outbox (services.store.sqlite.outbox) -----------------------------------
    async def outbox_add(self, entries: list[OutboxEntry], limit: int) -> list[OutboxAdded]:
        return await self.writer.run(lambda conn, rows: outbox.add(conn, rows, entries, limit))

    async def outbox_list(self, after: int, limit: int) -> list[OutboxEntry]:
        return await self._read(lambda conn: outbox.entries(conn, after, limit))

    async def outbox_remove(self, entries: list[OutboxEntry]) -> None:
        await self.writer.run(lambda conn, rows: outbox.remove(conn, rows, [e.number for e in entries]))

    # -- events (services.store.sqlite.events) --------------------------------------
    async def list_events(self, query: EventQuery) -> list[EventRecord]:
        return await self._read(lambda conn: event_table.list_events(conn, query))

    async def record_events(self, events: list[EventRecord], *, lazy: bool = True) -> list[int]:
        recorded = [EventRow.of(e) for e in events]

        def op(conn: sqlite3.Connection, rows: list[EventRow]) -> EventIds:
            rows.extend(recorded)
            return EventIds()

        future = await self.writer.enqueue(op, lazy=lazy)
        return [] if lazy else list(await future)

    def add_commit_listener(self, callback: CommitListener) -> None:
        self._listeners.append(callback)

    async def last_event_id(self) -> int:
        return await self._read(event_table.last_event_id)
