"""Subagent runs on SQLite (spawning a child with its run is sessions.py). Like
the other operations of this package, each write runs inside the writer's
transaction and appends the events it causes; nothing here commits.

The announce is exactly-once by construction: its message id is derived from
the run (`inboxmesh:announce:<run_id>`, sent as the child), the inbox's
(sender, message_id) key makes a second store impossible, and the run's
announce state changes in the same commit as the store.
"""

from __future__ import annotations

import sqlite3

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.runs.v1 import runs_pb2
from services.store.base import (
    AGENT_OPEN,
    ANNOUNCE_PENDING,
    ANNOUNCED,
    REQUESTER_GONE,
    AgentRecord,
    AnnounceOutcome,
    EventRow,
    RunRecord,
    RunWork,
)
from services.store.run_rules import (
    announce_envelope,
    announce_events,
    end,
    keep_if_kept,
    run_event,
    settle,
)
from services.store.sqlite import inbox
from services.store.sqlite.schema import row_after


def load(conn: sqlite3.Connection, *, run_id: str = "", child_id: str = "") -> RunRecord | None:
    column, value = ("run_id", run_id) if run_id else ("child_id", child_id)
    row = conn.execute(f"SELECT record FROM runs WHERE {column} = ?", (value,)).fetchone()
    return RunRecord.FromString(row[0]) if row else None


def _require(conn: sqlite3.Connection, run_id: str) -> RunRecord:
    run = load(conn, run_id=run_id)
    if run is None:
        raise errors.NotFound(f"no run {run_id}", reason=Reason.RUN_NOT_FOUND, metadata={"run_id": run_id})
    return run


def _save(conn: sqlite3.Connection, run: RunRecord) -> None:
    conn.execute(
        "UPDATE runs SET active = ?, started = ?, announce_state = ?, cleaned = ?, deadline_us = ?,"
        " archive_at_us = ?, archived = ?, record = ? WHERE run_id = ?",
        (int(run.status == runs_pb2.RUN_STATUS_RUNNING), int(run.started_at_us > 0), run.announce_state,
         int(run.cleaned_up_at_us > 0), run.deadline_us, run.archive_at_us, int(run.archived_at_us > 0),
         run.SerializeToString(), run.run_id))


def active_children(conn: sqlite3.Connection, requester_id: str) -> int:
    """Runs of one requester that have not ended (kept by the schema's triggers on runs.active)."""
    row = conn.execute("SELECT n FROM active_children WHERE requester_id = ?", (requester_id,)).fetchone()
    return int(row[0]) if row else 0


def insert(conn: sqlite3.Connection, events: list[EventRow], run: RunRecord) -> None:
    """Store the run of a child stored in the same transaction."""
    conn.execute(
        "INSERT INTO runs (run_id, child_id, requester_id, active, announce_state, deadline_us, record)"
        " VALUES (?, ?, ?, 1, ?, ?, ?)",
        (run.run_id, run.child_id, run.requester_id, run.announce_state, run.deadline_us, run.SerializeToString()))
    run_event(events, run, ev.EVENT_KIND_RUN_CREATED, run.created_at_us, detail=run.label or run.task[:200])


def end_run(conn: sqlite3.Connection, events: list[EventRow], run_id: str, status: int, result: str, at_us: int,
            traceparent: str) -> tuple[RunRecord, bool]:
    run = _require(conn, run_id)
    if run.status != runs_pb2.RUN_STATUS_RUNNING:
        return run, True
    if traceparent:
        run.traceparent = traceparent
    end(events, run, status, result, at_us)
    _save(conn, run)
    return run, False


def end_runs_of_closed(conn: sqlite3.Connection, events: list[EventRow], closed: list[AgentRecord], at_us: int) -> None:
    """Runs of agents closed before their task ended end as CLOSED."""
    for agent in closed:
        run = load(conn, child_id=agent.agent_id)
        if run is not None and run.status == runs_pb2.RUN_STATUS_RUNNING:
            end(events, run, runs_pb2.RUN_STATUS_CLOSED, agent.close_reason, at_us)
            _save(conn, run)


def mark_started(conn: sqlite3.Connection, events: list[EventRow], recipient: str, message_ids: list[str],
                 at_us: int) -> None:
    """The child consumed its task: the run has started."""
    row = conn.execute("SELECT record FROM runs WHERE child_id = ? AND started = 0", (recipient,)).fetchone()
    if row is None:
        return
    run = RunRecord.FromString(row[0])
    if run.task_message_id in message_ids:
        run.started_at_us = at_us
        _save(conn, run)
        run_event(events, run, ev.EVENT_KIND_RUN_STARTED, at_us)


def announce(conn: sqlite3.Connection, events: list[EventRow], run_id: str, at_us: int) -> AnnounceOutcome:
    run = _require(conn, run_id)
    if run.announce_state != ANNOUNCE_PENDING:
        return AnnounceOutcome(run)
    message_id = run.announce_message_id
    stored = conn.execute("SELECT seq FROM messages WHERE sender = ? AND message_id = ?",
                          (run.child_id, message_id)).fetchone()
    envelope = None
    if stored is not None:  # stored by an attempt whose run update was lost: never store twice
        settle(events, run, ANNOUNCED, at_us, "duplicate: stored by an earlier attempt", stored[0])
    else:
        requester = inbox.Inbox.load(conn, run.requester_id)
        if requester is None:
            settle(events, run, REQUESTER_GONE, at_us, f"requester {run.requester_id} does not exist")
        elif requester.state != AGENT_OPEN:
            reason = conn.execute("SELECT close_reason FROM agents WHERE agent_id = ?",
                                  (run.requester_id,)).fetchone()[0]
            settle(events, run, REQUESTER_GONE, at_us, f"requester {run.requester_id} is closed ({reason})")
        elif requester.unconsumed >= requester.capacity:
            detail = (f"requester {run.requester_id}'s inbox is full ({requester.unconsumed} of {requester.capacity});"
                      " retrying")
            if run.announce_detail != detail:
                run.announce_detail = detail
                run_event(events, run, ev.EVENT_KIND_RUN_ANNOUNCE_DEFERRED, at_us, detail=detail)
                _save(conn, run)
            return AnnounceOutcome(run, retry=True)
        else:
            envelope = announce_envelope(run, at_us)
            seq = inbox.store_envelope(conn, requester, envelope, at_us)
            requester.save(conn)
            events += announce_events(run, seq, at_us)
            settle(events, run, ANNOUNCED, at_us, "accepted", seq)
    keep_if_kept(events, run, at_us)
    _save(conn, run)
    return AnnounceOutcome(run, envelope)


def finish_cleanup(conn: sqlite3.Connection, events: list[EventRow], run_id: str, detail: str,
                   at_us: int) -> RunRecord:
    run = _require(conn, run_id)
    if not run.cleaned_up_at_us:
        run.cleaned_up_at_us = at_us
        _save(conn, run)
        run_event(events, run, ev.EVENT_KIND_RUN_CLEANED_UP, at_us, detail=detail)
    return run


def archive(conn: sqlite3.Connection, events: list[EventRow], run_id: str, at_us: int) -> RunRecord:
    run = _require(conn, run_id)
    if not run.archived_at_us:
        run.archived_at_us = at_us
        _save(conn, run)
        run_event(events, run, ev.EVENT_KIND_RUN_ARCHIVED, at_us)
    return run


def work(conn: sqlite3.Connection, now_us: int, limit: int) -> RunWork:
    def ids(where: str, *params) -> list[str]:
        sql = f"SELECT run_id FROM runs WHERE archived = 0 AND {where} ORDER BY row LIMIT ?"
        return [r[0] for r in conn.execute(sql, (*params, limit)).fetchall()]

    return RunWork(
        overdue=ids("active = 1 AND deadline_us > 0 AND deadline_us <= ?", now_us),
        pending=ids("announce_state = ?", ANNOUNCE_PENDING),
        cleanup=ids("announce_state IN (?, ?) AND cleaned = 0", ANNOUNCED, REQUESTER_GONE),
        archivable=ids("announce_state IN (?, ?) AND cleaned = 1 AND archive_at_us <= ?", ANNOUNCED,
                       REQUESTER_GONE, now_us),
    )


def list_runs(conn: sqlite3.Connection, requester_id: str, include_archived: bool, after_key: str,
              limit: int) -> list[RunRecord]:
    after_row = row_after(conn, "runs", "run_id", after_key)
    rows = conn.execute(
        "SELECT record FROM runs WHERE requester_id = ? AND row > ?" + ("" if include_archived else
                                                                       " AND archived = 0")
        + " ORDER BY row LIMIT ?", (requester_id, after_row, limit)).fetchall()
    return [RunRecord.FromString(r[0]) for r in rows]
