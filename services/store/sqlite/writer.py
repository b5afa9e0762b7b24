"""Group commit for SQLite, on the event loop.

Write operations are queued; a flush scheduled on the loop runs every
operation queued by then in one transaction, each inside its own SAVEPOINT
(so one failing operation is rolled back alone), and resolves their futures
only after COMMIT returned, i.e. after the data is on disk.

Why on the loop and not on a thread: on our 2-core machines a hop to a
writer thread and back cost about 0.25 ms per commit, more than the fsync
itself (0.2-0.35 ms), and measured slower at every concurrency
(docs/benchmarks.md). The loop is blocked for the duration of a commit;
gRPC's core keeps receiving meanwhile, and everything that arrived is
committed together in the next flush, so batching grows with load.

While the loop is busy, the flush waits for company (`_linger`): gRPC hands
the loop one new call per turn or so, so a flush on the very next turn
would commit concurrent calls (64 registrations at once, acks of many Ack
calls) one by one, each paying a whole commit. The flush is put off turn by
turn while turns keep taking time (other work runs, and more operations are
likely to come with it), for at most LINGER_FACTOR times what the last
commit took (so a busy loop spends at most about 1/(1 + LINGER_FACTOR) of
its time committing) and never beyond LINGER_MAX_S; a turn with nothing else
to do (an idle mesh), a full batch, or callers waiting for room flush at
once, so a lone write waits no more than one idle turn.

Lazy operations (bookkeeping whose loss on a crash is harmless, such as
"this message was streamed") never start a commit of their own: they ride
along, first, with the next regular flush, or are flushed after
`lazy_delay_s` when nothing else comes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from services.store.base import CommitListener, EventRow
from services.store.sqlite.schema import INSERT_EVENT

log = logging.getLogger(__name__)
Op = Callable[[sqlite3.Connection, list[EventRow]], Any]
"""A write operation: runs inside the transaction, may append event rows to
the list it is given; they are inserted only if the operation succeeds."""
_Queued = tuple[Op, "asyncio.Future[Any]"]
LINGER_FACTOR = 4.0
"""A busy loop's flush waits at most this many times what the last commit took."""
LINGER_MAX_S = 0.005
"""... and never longer than this (a slow disk does not make writes wait for long). Both are the loop
thread's CPU time, not the clock's: while other processes hold the cores the loop does nothing, so a wait
measured on the clock would end having let no company in (64 registrations at once took 26-29 commits
with four busy processes on our 2 cores, against 7-11 on a quiet machine)."""
LINGER_WALL_MAX_S = 0.025
"""... and, on the clock, never longer than this, however busy the machine."""
IDLE_TURN_S = 50e-6
"""A turn of the loop this short did nothing but run the flush's own callback: nothing else is coming
soon, flush now. (An idle turn of asyncio's loop takes about 5-15 us here; a turn that serves gRPC calls,
100 us and more.)"""


CACHE_KIB = 65_536
"""SQLite's page cache of the connection, in KiB (its default is 2,000): with thousands of agents the
inserts into the messages and events indexes land on random pages, and a cache smaller than those indexes
reads most of them back from the file on every commit. Filled only as pages are used."""


class EventIds(list[int]):
    """Return an instance from an operation to get back, once committed, the
    ids of the events that operation recorded."""


def connect(path: Path, *, synchronous: str, busy_timeout_ms: int) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    conn.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
    return conn


class Writer:
    """The writing side of the connection: group commit, bounded queue
    (callers wait for room when it is full)."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        max_pending: int,
        max_ops_per_commit: int,
        lazy_delay_s: float = 0.05,
    ):
        self._conn = conn
        self._max_ops = max_ops_per_commit
        self._lazy_delay_s = lazy_delay_s
        self._max_pending = max_pending
        self._pending: collections.deque[_Queued] = collections.deque()
        self._lazy: collections.deque[_Queued] = collections.deque()
        self._room: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_handle: asyncio.Handle | None = None
        self._lazy_timer: asyncio.TimerHandle | None = None
        self._lazy_due = False
        self._closed = False
        self.after_commit: CommitListener | None = None
        """Called after each commit with (first event id, event rows)."""
        self._last_commit_s = 0.0
        """How long the last commit took (the linger's measure)."""
        self.commits = 0
        self.ops = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Semaphore(self._max_pending)

    async def enqueue(self, op: Op, *, lazy: bool = False) -> asyncio.Future[Any]:
        """Queue op behind every earlier one and return its future (resolved
        after the commit that includes it). Waits while the queue is full."""
        if self._closed or self._room is None or self._loop is None:
            raise errors.Unavailable("the store is shutting down; nothing was written", reason=Reason.SHUTTING_DOWN)
        await self._room.acquire()
        fut = self._loop.create_future()
        if lazy:
            self._lazy.append((op, fut))
            if self._lazy_timer is None:
                self._lazy_timer = self._loop.call_later(self._lazy_delay_s, self._lazy_expired)
        else:
            self._pending.append((op, fut))
            self._schedule_flush()
        return fut

    def _schedule_flush(self) -> None:
        if self._flush_handle is None and self._loop is not None:
            now = time.perf_counter()
            self._flush_handle = self._loop.call_soon(self._linger, now, time.thread_time(), now)

    def _linger(self, first: float, first_cpu: float, turn: float) -> None:
        """Flush, or wait one more turn of the loop (see the module's doc): `first` is when the flush was
        scheduled (`first_cpu` on the loop thread's CPU clock), `turn` when the previous turn ran this."""
        assert self._loop is not None and self._room is not None  # started: nothing is queued before
        now = time.perf_counter()
        busy = now - turn > IDLE_TURN_S
        budget = min(LINGER_MAX_S, LINGER_FACTOR * self._last_commit_s)
        if (busy and time.thread_time() - first_cpu < budget and now - first < LINGER_WALL_MAX_S
                and len(self._pending) < self._max_ops and not self._room.locked()):
            self._flush_handle = self._loop.call_soon(self._linger, first, first_cpu, now)
            return
        self._flush()

    async def run(self, op: Op) -> Any:
        return await (await self.enqueue(op))

    def _lazy_expired(self) -> None:
        self._lazy_timer = None
        self._lazy_due = True
        self._schedule_flush()

    def _flush(self) -> None:
        self._flush_handle = None
        while self._pending or (self._lazy and self._lazy_due):
            batch: list[_Queued] = []
            while self._lazy and len(batch) < self._max_ops:
                batch.append(self._lazy.popleft())
            while self._pending and len(batch) < self._max_ops:
                batch.append(self._pending.popleft())
            results, first_event_id, events = self._apply([op for op, _ in batch])
            self._complete(batch, results, first_event_id, events)
        self._lazy_due = False
        if not self._lazy and self._lazy_timer is not None:
            self._lazy_timer.cancel()
            self._lazy_timer = None

    def _apply(self, ops: list[Op]) -> tuple[list[tuple[bool, Any]], int, list[EventRow]]:
        conn = self._conn
        results: list[tuple[bool, Any]] = []
        events: list[EventRow] = []
        started = time.perf_counter()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            failure = errors.Unavailable(f"store could not start a transaction: {exc}; nothing was written",
                                         reason=Reason.STORE_UNAVAILABLE)
            return [(False, failure)] * len(ops), 0, []
        first_event_id = 0
        try:  # the savepoints too: sqlite failing one (an I/O error) fails the batch, never leaves it open
            for op in ops:
                conn.execute("SAVEPOINT op")
                op_events: list[EventRow] = []
                try:
                    value = op(conn, op_events)
                    if op_events:  # inside the savepoint: an event the table cannot hold fails its operation only
                        conn.executemany(INSERT_EVENT, [row.values() for row in op_events])
                except Exception as exc:  # one operation failing must not sink the others
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    if not isinstance(exc, errors.MeshError):
                        log.exception("store operation failed")
                        exc = errors.Internal(f"store operation failed: {exc!r}")
                    results.append((False, exc))
                else:
                    conn.execute("RELEASE op")
                    if isinstance(value, EventIds):
                        value.extend(range(len(events), len(events) + len(op_events)))  # offsets until committed
                    results.append((True, value))
                    events += op_events
            if events:
                # One writer holds the lock for the whole transaction (and a rolled-back savepoint takes its
                # ids back), so the ids of this batch are contiguous.
                first_event_id = conn.execute("SELECT last_insert_rowid()").fetchone()[0] - len(events) + 1
            conn.execute("COMMIT")
        except Exception as exc:  # sqlite3.Error, or anything else: never leave the transaction open
            log.error("commit failed, %d operations rolled back: %s", len(ops), exc)
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            failure = errors.Unavailable(f"store commit failed: {exc}; nothing was written",
                                         reason=Reason.STORE_UNAVAILABLE)
            return [(False, failure)] * len(ops), 0, []
        self._last_commit_s = time.perf_counter() - started
        self.commits += 1
        self.ops += len(ops)
        for ok, value in results:
            if ok and isinstance(value, EventIds):
                value[:] = [first_event_id + offset for offset in value]
        return results, first_event_id, events

    def _complete(self, batch: list[_Queued], results: list[tuple[bool, Any]], first_event_id: int,
                  events: list[EventRow]) -> None:
        assert self._room is not None  # started: nothing is queued before
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

    async def close(self) -> None:
        """Write what is queued (lazy operations too), then stop. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        if self._lazy_timer is not None:
            self._lazy_timer.cancel()
            self._lazy_timer = None
        self._lazy_due = True
        self._flush()
