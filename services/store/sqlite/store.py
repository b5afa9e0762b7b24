"""The embedded default store: one SQLite file in WAL mode, durable commits.

Writes are operations (services.store.sqlite_ops) queued to a group-commit
writer (services.store.sqlite_runner); reads run on the same connection
between commits. Every check that must be atomic (duplicates, capacity,
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
from typing import TypeVar

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from services.config import StoreConfig
from services.store import base
from services.store.base import (
    AGENT_OPEN,
    AckOutcome,
    AgentRecord,
    AnnounceOutcome,
    AppendItem,
    CloseOutcome,
    DeliveryBatch,
    EventQuery,
    Frontier,
    MessageRecord,
    RunRecord,
    RunWork,
    SendOutcome,
    SpawnLimits,
)
from services.store.sqlite import inbox as ops
from services.store.sqlite import runs
from services.store.sqlite.inbox import AGENT_COLUMNS, EVENT_COLUMNS, MESSAGE_COLUMNS, agent_of, message_of
from services.store.sqlite.schema import SCHEMA, SCHEMA_VERSION, UPGRADABLE
from services.store.sqlite.writer import EventIds, Writer, connect

log = logging.getLogger(__name__)
T = TypeVar("T")


class SqliteStore(base.Store):
    def __init__(self, config: StoreConfig):
        self.config = config
        self.path = Path(config.path)
        self._writer: Writer | None = None
        self._conn: sqlite3.Connection | None = None
        self._listeners: list[Callable[[int, list[tuple]], None]] = []

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
                conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
                log.info("upgraded %s from schema version %s to %d", self.path, row[0], SCHEMA_VERSION)
            elif int(row[0]) != SCHEMA_VERSION:
                raise errors.FailedPrecondition(
                    f"{self.path} has schema version {row[0]}, this mesh needs {SCHEMA_VERSION}; use another"
                    " --data-dir or remove the old file", reason=Reason.SCHEMA_MISMATCH)
        except BaseException:
            conn.close()
            raise
        self._writer = Writer(conn, max_pending=self.config.max_pending_writes,
                              max_ops_per_commit=self.config.max_ops_per_commit, insert_events=ops.INSERT_EVENT)
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
            raise errors.Unavailable("the store is not running", reason=Reason.STORE_CLOSED)
        return self._writer

    async def _read(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run a read on the connection. Reads are short indexed queries;
        outside a flush no transaction is open, so they see every commit."""
        if self._conn is None or self._writer is None:
            raise errors.Unavailable("the store is not running", reason=Reason.STORE_CLOSED)
        return op(self._conn)

    # -- registry -----------------------------------------------------------
    async def create_agent(self, record: AgentRecord) -> AgentRecord:
        return await self.writer.run(lambda conn, events: ops.create_agent(conn, events, record))

    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        def op(conn: sqlite3.Connection) -> AgentRecord | None:
            row = conn.execute(f"SELECT {AGENT_COLUMNS} FROM agents WHERE agent_id = ?", (agent_id,)).fetchone()
            return agent_of(row) if row else None

        return await self._read(op)

    async def find_agents(self, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]:
        sql = (f"SELECT {AGENT_COLUMNS} FROM agents WHERE scope_id = ? AND name = ?"
               + ("" if include_closed else f" AND state = {AGENT_OPEN}") + " ORDER BY row")
        return await self._read(lambda conn: [agent_of(r) for r in conn.execute(sql, (scope_id, name)).fetchall()])

    async def list_agents(
        self, *, scope_id: str = "", parent_id: str = "", include_closed: bool, after_key: str, limit: int
    ) -> list[AgentRecord]:
        column, value = ("parent_id", parent_id) if parent_id else ("scope_id", scope_id)

        def op(conn: sqlite3.Connection) -> list[AgentRecord]:
            after_row = ops.row_after(conn, "agents", "agent_id", after_key)
            rows = conn.execute(
                f"SELECT {AGENT_COLUMNS} FROM agents WHERE {column} = ? AND row > ?"
                + ("" if include_closed else f" AND state = {AGENT_OPEN}") + " ORDER BY row LIMIT ?",
                (value, after_row, limit)).fetchall()
            return [agent_of(r) for r in rows]

        return await self._read(op)

    async def close_agent(self, agent_id: str, reason: str, at_us: int) -> CloseOutcome:
        def op(conn: sqlite3.Connection, events: list[tuple]) -> CloseOutcome:
            outcome = ops.close_agent(conn, events, agent_id, reason, at_us)
            runs.end_runs_of_closed(conn, events, outcome.closed, at_us)
            return outcome

        return await self.writer.run(op)

    async def set_credential(self, agent_id: str, credential_hash: bytes) -> AgentRecord:
        return await self.writer.run(lambda conn, events: runs.set_credential(conn, events, agent_id,
                                                                              credential_hash))

    # -- subagent runs ------------------------------------------------------
    async def create_child(self, record: AgentRecord, run: RunRecord, limits: SpawnLimits, *,
                           resume: bool = False) -> AgentRecord:
        # one transaction: an agent that exists has its run, so `resume` never reaches here
        return await self.writer.run(lambda conn, events: runs.create_child(conn, events, record, run, limits))

    async def get_run(self, *, run_id: str = "", child_id: str = "") -> RunRecord | None:
        return await self._read(lambda conn: runs.load(conn, run_id=run_id, child_id=child_id))

    async def list_runs(self, requester_id: str, include_archived: bool, after_key: str,
                        limit: int) -> list[RunRecord]:
        return await self._read(lambda conn: runs.list_runs(conn, requester_id, include_archived, after_key, limit))

    async def end_run(self, run_id: str, status: int, result: str, at_us: int,
                      traceparent: str = "") -> tuple[RunRecord, bool]:
        return await self.writer.run(lambda conn, events: runs.end_run(conn, events, run_id, status, result, at_us,
                                                                       traceparent))

    async def announce_run(self, run_id: str, at_us: int) -> AnnounceOutcome:
        return await self.writer.run(lambda conn, events: runs.announce(conn, events, run_id, at_us))

    async def finish_cleanup(self, run_id: str, detail: str, at_us: int) -> RunRecord:
        return await self.writer.run(lambda conn, events: runs.finish_cleanup(conn, events, run_id, detail, at_us))

    async def archive_run(self, run_id: str, at_us: int) -> RunRecord:
        return await self.writer.run(lambda conn, events: runs.archive(conn, events, run_id, at_us))

    async def run_work(self, now_us: int, limit: int) -> RunWork:
        return await self._read(lambda conn: runs.work(conn, now_us, limit))

    # -- routing sessions ---------------------------------------------------
    async def session_agent(self, session_key: str, new_agent: AgentRecord) -> tuple[AgentRecord, bool]:
        return await self.writer.run(lambda conn, events: runs.session_agent(conn, events, session_key, new_agent))

    # -- inbox --------------------------------------------------------------
    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        return await self.writer.run(lambda conn, events: ops.append(conn, events, sender_id, items, at_us))

    async def next_deliveries(
        self, recipient: str, after_sequence: int, limit: int, max_attempts: int, now_us: int, in_flight: int = 0
    ) -> DeliveryBatch:
        # capacity is settled inside the append's transaction: whatever is stored may be delivered
        return await self.writer.run(lambda conn, events: ops.next_deliveries(
            conn, events, recipient, after_sequence, limit, max_attempts, now_us))

    async def mark_delivered(
        self, recipient: str, envelopes: list[envelope_pb2.Envelope], at_us: int
    ) -> asyncio.Future:
        keys = [(e.sequence, e.message_id, e.sender, trace_id_of(e.trace.traceparent), e.in_reply_to,
                 e.conversation_id) for e in envelopes]
        return await self.writer.enqueue(
            lambda conn, events: ops.mark_delivered(conn, events, recipient, keys, at_us), lazy=True)

    async def ack(self, recipient: str, sequences: list[int], at_us: int, turn: int = 0) -> list[AckOutcome]:
        def op(conn: sqlite3.Connection, events: list[tuple]) -> list[AckOutcome]:
            outcomes = ops.ack(conn, events, recipient, sequences, at_us, turn)
            consumed = [o.message_id for o in outcomes if o.status == inbox_pb2.ACK_STATUS_CONSUMED]
            if consumed:
                runs.mark_started(conn, events, recipient, consumed, at_us)
            return outcomes

        return await self.writer.run(op)

    async def get_frontier(self, agent_id: str) -> Frontier | None:
        return await self._read(lambda conn: ops.get_frontier(conn, agent_id))

    async def get_message_by_sender(self, sender: str, message_id: str) -> MessageRecord | None:
        sql = f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE sender = ? AND message_id = ?"
        return await self._read(lambda conn: self._one_message(conn.execute(sql, (sender, message_id)).fetchone()))

    async def get_message_by_inbox(self, recipient: str, sequence: int) -> MessageRecord | None:
        sql = f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE recipient = ? AND seq = ?"
        return await self._read(lambda conn: self._one_message(conn.execute(sql, (recipient, sequence)).fetchone()))

    @staticmethod
    def _one_message(row: tuple | None) -> MessageRecord | None:
        return message_of(row) if row else None

    async def list_dead_letters(
        self, *, recipient: str = "", sender: str = "", after_key: str, limit: int
    ) -> tuple[list[MessageRecord], str]:
        column, value = ("sender", sender) if sender else ("recipient", recipient)
        try:
            after_id = int(after_key or 0)
        except ValueError:
            raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason=Reason.BAD_PAGE_TOKEN) from None
        columns = ", ".join("m." + c.strip() for c in MESSAGE_COLUMNS.split(","))

        def op(conn: sqlite3.Connection) -> tuple[list[MessageRecord], str]:
            rows = conn.execute(
                f"SELECT d.id, {columns} FROM dead_letters d JOIN messages m ON m.recipient = d.recipient"
                f" AND m.seq = d.seq WHERE d.{column} = ? AND d.id > ? ORDER BY d.id LIMIT ?",
                (value, after_id, limit)).fetchall()
            return [message_of(r[1:]) for r in rows], (str(rows[-1][0]) if len(rows) == limit else "")

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
        sql = f"SELECT event_id, {EVENT_COLUMNS} FROM events WHERE {' AND '.join(where)} ORDER BY event_id LIMIT ?"
        params.append(query.limit)
        return await self._read(
            lambda conn: [base.event_of(r[0], r[1:]) for r in conn.execute(sql, params).fetchall()])

    async def record_events(self, events: list[ev.Event], *, lazy: bool = True) -> list[int]:
        rows = [base.event_row(e.at_us, e.kind, e.agent_id, message_id=e.message_id, sender=e.sender,
                              recipient=e.recipient, seq=e.sequence, detail=e.detail, trace_id=e.trace_id,
                              turn=e.turn, in_reply_to=e.in_reply_to, conversation_id=e.conversation_id)
                for e in events]
        def op(conn: sqlite3.Connection, out: list[tuple]) -> EventIds:
            out.extend(rows)
            return EventIds()

        future = await self.writer.enqueue(op, lazy=lazy)
        return [] if lazy else list(await future)

    def add_commit_listener(self, callback) -> None:
        self._listeners.append(callback)

    async def last_event_id(self) -> int:
        return await self._read(lambda conn: conn.execute("SELECT max(event_id) FROM events").fetchone()[0] or 0)
