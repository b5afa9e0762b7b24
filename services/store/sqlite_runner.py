"""SQLite connections driven from asyncio without blocking the event loop.

sqlite3 is a blocking library, so each connection lives on one thread of
its own (the only threads in the mesh). The writer joins every operation
queued while the previous commit was running into one transaction (group
commit): each operation runs inside its own SAVEPOINT, so one failing
operation is rolled back alone, and every caller hears its result only
after COMMIT returned, i.e. after the data is on disk.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from services import errors

log = logging.getLogger(__name__)
T = TypeVar("T")
Op = Callable[[sqlite3.Connection, list[tuple]], Any]
"""A write operation: runs inside the transaction, may append event rows to
the list it is given; they are inserted only if the operation succeeds."""


def connect(path: Path, *, synchronous: str, busy_timeout_ms: int, readonly: bool = False) -> sqlite3.Connection:
    uri = f"file:{path}?mode=ro" if readonly else f"file:{path}"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    if not readonly:
        conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute("PRAGMA foreign_keys=OFF")
    return conn


class Writer:
    """The single writing connection, with group commit and a bounded queue."""

    def __init__(self, conn: sqlite3.Connection, *, max_pending: int, max_ops_per_commit: int, insert_events: str):
        self._conn = conn
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-writer")
        self._pending: collections.deque[tuple[Op, asyncio.Future]] = collections.deque()
        self._room = asyncio.Semaphore(max_pending)
        self._wake = asyncio.Event()
        self._max_ops = max_ops_per_commit
        self._task: asyncio.Task | None = None
        self._closing = False
        self.commits = 0
        self.ops = 0
        self._insert_events = insert_events
        self.after_commit: Callable[[int, list[tuple]], None] | None = None
        """Called on the loop after each commit with (first event id, event rows)."""

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sqlite-writer")

    async def enqueue(self, op: Op) -> asyncio.Future:
        """Queue op behind every earlier one and return its future (resolved
        after the commit that includes it). Waits while the queue is full."""
        if self._closing:
            raise errors.Unavailable("the store is shutting down; nothing was written", reason="SHUTTING_DOWN")
        await self._room.acquire()
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((op, fut))
        self._wake.set()
        return fut

    async def run(self, op: Op) -> Any:
        return await (await self.enqueue(op))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = []
                while self._pending and len(batch) < self._max_ops:
                    batch.append(self._pending.popleft())
                ops = [op for op, _ in batch]
                try:
                    results, first_event_id, events = await loop.run_in_executor(self._thread, self._apply, ops)
                except BaseException as exc:  # the loop is going away: fail the batch, then stop
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(errors.Unavailable(f"store writer stopped: {exc!r}"))
                        self._room.release()
                    raise
                for (_, fut), (ok, value) in zip(batch, results):
                    self._room.release()
                    if fut.done():
                        continue
                    if ok:
                        fut.set_result(value)
                    else:
                        fut.set_exception(value)
                if self.after_commit is not None and events:
                    self.after_commit(first_event_id, events)
            if self._closing and not self._pending:
                return

    def _apply(self, ops: list[Op]) -> tuple[list[tuple[bool, Any]], int, list[tuple]]:
        conn = self._conn
        results: list[tuple[bool, Any]] = []
        events: list[tuple] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            failure = errors.Unavailable(f"store could not start a transaction: {exc}; nothing was written")
            return [(False, failure)] * len(ops), 0, []
        for op in ops:
            conn.execute("SAVEPOINT op")
            op_events: list[tuple] = []
            try:
                value = op(conn, op_events)
            except Exception as exc:  # one operation failing must not sink the others
                conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                if not isinstance(exc, errors.MeshError):
                    log.exception("store operation failed")
                    exc = errors.Internal(f"store operation failed: {exc!r}")
                results.append((False, exc))
            else:
                conn.execute("RELEASE op")
                results.append((True, value))
                events += op_events
        first_event_id = 0
        try:
            if events:
                conn.executemany(self._insert_events, events)
                # One writer holds the lock for the whole transaction, so the
                # AUTOINCREMENT ids of this batch are contiguous.
                first_event_id = conn.execute("SELECT last_insert_rowid()").fetchone()[0] - len(events) + 1
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            log.error("commit failed, %d operations rolled back: %s", len(ops), exc)
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            failure = errors.Unavailable(f"store commit failed: {exc}; nothing was written")
            return [(False, failure)] * len(ops), 0, []
        self.commits += 1
        self.ops += len(ops)
        return results, first_event_id, events

    async def close(self) -> None:
        if self._task is None:
            return
        self._closing = True
        self._wake.set()
        task, self._task = self._task, None
        try:
            await task
        finally:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._conn.close)
            self._thread.shutdown(wait=True)


class Reader:
    """A read-only connection on its own thread (WAL lets it read while the
    writer commits)."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-reader")
        self._closed = False

    async def run(self, op: Callable[[sqlite3.Connection], T]) -> T:
        if self._closed:
            raise errors.Unavailable("the store is shutting down", reason="SHUTTING_DOWN")
        return await asyncio.get_running_loop().run_in_executor(self._thread, op, self._conn)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._thread, self._conn.close)
        self._thread.shutdown(wait=True)
