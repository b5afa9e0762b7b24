"""The gateway's task book: what the A2A protocol needs that the mesh's record does not hold, in one
SQLite file of the gateway's (`--state`), written with fsync before anything is acked or answered.

- tasks: one per A2A message a client sent (its id: `task_id`, also the mesh message id and, with the
  client's `a2a:client/<principal>` address as sender, the idempotency key), the request itself;
- task_events: each task's A2A stream, in order: SUBMITTED when the mesh accepted it, WORKING when the
  exposed agent consumed it (the record's MESSAGE_CONSUMED), COMPLETED with the agent's answer (its reply,
  read from the gateway agent's inbox), FAILED when the mesh dead-lettered it or the agent closed without
  answering. `seq` numbers every event of the book, increasing: the cursor a resuming client names
  (`Last-Event-ID`). `source` names what produced an event (a record event, an answer's message id), so
  a fact read twice (after a restart, a redelivery) is stored once;
- cursor: the last mesh event id the record watch handled, so a restarted gateway resumes after it.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from a2a.types import a2a_pb2 as a2a

TERMINAL = frozenset({a2a.TASK_STATE_COMPLETED, a2a.TASK_STATE_FAILED, a2a.TASK_STATE_CANCELED,
                      a2a.TASK_STATE_REJECTED})

SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
  task_id TEXT PRIMARY KEY, principal TEXT NOT NULL, context_id TEXT NOT NULL, client_message_id TEXT NOT NULL,
  target TEXT NOT NULL, request BLOB NOT NULL, created_us INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS tasks_by_principal ON tasks (principal, created_us);
CREATE TABLE IF NOT EXISTS task_events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, task_id TEXT NOT NULL, source TEXT NOT NULL UNIQUE,
  state INTEGER NOT NULL, message BLOB, artifact BLOB, at_us INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS task_events_by_task ON task_events (task_id, seq);
CREATE TABLE IF NOT EXISTS cursor (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass(frozen=True)
class TaskRow:
    task_id: str
    principal: str
    context_id: str
    client_message_id: str
    target: str
    request: a2a.Message
    created_us: int


@dataclass(frozen=True)
class TaskEvent:
    seq: int
    task_id: str
    state: int
    message: a2a.Message | None
    artifact: a2a.Artifact | None
    at_us: int


def _now_us() -> int:
    return time.time_ns() // 1000


class TaskBook:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        path.chmod(0o600)

    def close(self) -> None:
        self._db.close()

    # -- tasks ----------------------------------------------------------------------------
    def add_task(self, task: TaskRow) -> bool:
        """Store a new task with its SUBMITTED event (one transaction); False when it exists (a retry)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute(
                "INSERT OR IGNORE INTO tasks VALUES (?, ?, ?, ?, ?, ?, ?)",
                (task.task_id, task.principal, task.context_id, task.client_message_id, task.target,
                 task.request.SerializeToString(), task.created_us))
            if cur.rowcount == 0:
                return False
            self._db.execute("INSERT INTO task_events (task_id, source, state, at_us) VALUES (?, ?, ?, ?)",
                             (task.task_id, f"submitted:{task.task_id}", a2a.TASK_STATE_SUBMITTED, task.created_us))
            return True

    def drop_task(self, task_id: str) -> None:
        """Forget a task the mesh refused (nothing of it was stored there)."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
            self._db.execute("DELETE FROM tasks WHERE task_id = ?", (task_id,))

    def task(self, task_id: str) -> TaskRow | None:
        row = self._db.execute("SELECT * FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
        return _task(row) if row else None

    def tasks(self, principal: str, *, context_id: str = "", after_created_us: int = 0,
              limit: int = 100) -> list[TaskRow]:
        """A principal's tasks, oldest first, created after `after_created_us`."""
        query = "SELECT * FROM tasks WHERE principal = ? AND created_us > ?"
        args: list = [principal, after_created_us]
        if context_id:
            query += " AND context_id = ?"
            args.append(context_id)
        rows = self._db.execute(query + " ORDER BY created_us, task_id LIMIT ?", (*args, limit)).fetchall()
        return [_task(r) for r in rows]

    def open_tasks(self, target: str, *, principal: str = "", context_id: str = "") -> list[TaskRow]:
        """Tasks of `target` whose last state is not terminal, newest first."""
        marks = ",".join("?" * len(TERMINAL))
        query = ("SELECT t.* FROM tasks t WHERE t.target = ? AND (SELECT e.state FROM task_events e WHERE"
                 f" e.task_id = t.task_id ORDER BY e.seq DESC LIMIT 1) NOT IN ({marks})")
        args: list = [target, *TERMINAL]
        if principal:
            query += " AND t.principal = ?"
            args.append(principal)
        if context_id:
            query += " AND t.context_id = ?"
            args.append(context_id)
        return [_task(r) for r in self._db.execute(query + " ORDER BY t.created_us DESC", args).fetchall()]

    def prune(self, ended_before_us: int) -> int:
        """Forget tasks whose last event is terminal and older than `ended_before_us`: how many."""
        marks = ",".join("?" * len(TERMINAL))
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            ids = [r[0] for r in self._db.execute(
                "SELECT task_id FROM task_events e WHERE seq = (SELECT max(seq) FROM task_events WHERE task_id ="
                f" e.task_id) AND state IN ({marks}) AND at_us < ?", (*TERMINAL, ended_before_us)).fetchall()]
            for task_id in ids:
                self._db.execute("DELETE FROM task_events WHERE task_id = ?", (task_id,))
                self._db.execute("DELETE FROM tasks WHERE task_id = ?", (task_id,))
        return len(ids)

    # -- events ---------------------------------------------------------------------------
    def add_event(self, task_id: str, source: str, state: int, *, message: a2a.Message | None = None,
                  artifact: a2a.Artifact | None = None) -> int | None:
        """Append an event unless its source was recorded or the task already ended: its seq, else None."""
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            last = self._db.execute("SELECT state FROM task_events WHERE task_id = ? ORDER BY seq DESC LIMIT 1",
                                    (task_id,)).fetchone()
            if last is None or last[0] in TERMINAL:
                return None
            cur = self._db.execute(
                "INSERT OR IGNORE INTO task_events (task_id, source, state, message, artifact, at_us)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (task_id, source, state, message.SerializeToString() if message is not None else None,
                 artifact.SerializeToString() if artifact is not None else None, _now_us()))
            return cur.lastrowid if cur.rowcount else None

    def events(self, task_id: str, after_seq: int = 0) -> list[TaskEvent]:
        rows = self._db.execute("SELECT seq, task_id, state, message, artifact, at_us FROM task_events"
                                " WHERE task_id = ? AND seq > ? ORDER BY seq", (task_id, after_seq)).fetchall()
        return [TaskEvent(seq, tid, state, _parse(a2a.Message, m), _parse(a2a.Artifact, art), at)
                for seq, tid, state, m, art, at in rows]

    # -- the record watch's cursor -------------------------------------------------------------
    def cursor(self) -> int:
        row = self._db.execute("SELECT value FROM cursor WHERE name = 'record'").fetchone()
        return row[0] if row else 0

    def set_cursor(self, event_id: int) -> None:
        with self._db:
            self._db.execute("INSERT INTO cursor VALUES ('record', ?) ON CONFLICT (name) DO UPDATE SET"
                             " value = max(value, excluded.value)", (event_id,))


def _task(row) -> TaskRow:
    task_id, principal, context_id, client_message_id, target, request, created_us = row
    return TaskRow(task_id, principal, context_id, client_message_id, target,
                   a2a.Message.FromString(request), created_us)


def _parse(cls, blob):
    return cls.FromString(blob) if blob is not None else None
