"""WAL checkpoints on a thread of their own, off the event loop.

SQLite's default checkpoints the WAL inside the COMMIT that takes it past 1,000 pages: that commit, on
the mesh's event loop, copies the pages into the database file and fsyncs it. With thousands of agents a
message dirties a dozen pages of random indexes, so under load every few commits paid for a checkpoint,
and COMMIT was the largest single cost of the mesh (docs/benchmarks.md). Here the writer's connection
has automatic checkpoints off, and a thread with its own connection runs PASSIVE checkpoints (which never
wait for or block the writer) when commits have happened, at most every `interval_s`. sqlite3 releases
the GIL while SQLite works, so the copy and its fsync run beside the loop. Durability is unchanged: a
commit is on disk when its WAL frames are (synchronous=FULL fsyncs the WAL at every commit); a checkpoint
only moves committed pages into the main file.

The WAL stays bounded: when a checkpoint leaves more than `restart_pages` in it (PASSIVE could not
finish because a reader held an old snapshot), the next one is a RESTART, which waits (busy_timeout) for
readers and makes the writer start the WAL from its beginning again.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, path: Path, *, busy_timeout_ms: int, interval_s: float = 0.05,
                 restart_pages: int = 100_000):
        self._path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._interval_s = interval_s
        self._restart_pages = restart_pages
        self._due = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.checkpoints = 0
        """Checkpoints run (tests read it)."""
        self.failures = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sqlite-checkpoints", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """The writer committed: a checkpoint is due (cheap; called on the loop after every commit)."""
        self._due.set()

    def _run(self) -> None:
        conn = sqlite3.connect(str(self._path), isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
            mode = "PASSIVE"
            while True:
                self._due.wait()
                if self._stopping:
                    return
                self._due.clear()
                try:
                    busy, wal_pages, moved = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
                except sqlite3.Error as exc:  # the next commit tries again; the WAL only grows meanwhile
                    self.failures += 1
                    log.warning("WAL checkpoint of %s failed: %s", self._path, exc)
                else:
                    self.checkpoints += 1
                    mode = "RESTART" if wal_pages - moved > self._restart_pages else "PASSIVE"
                    if mode == "RESTART":
                        log.info("WAL of %s at %d pages, %d not yet checkpointed: the next checkpoint waits for"
                                 " readers", self._path, wal_pages, wal_pages - moved)
                time.sleep(self._interval_s)  # at most one checkpoint per interval
        finally:
            conn.close()

    def stop(self) -> None:
        """Stop the thread (the last connection's close checkpoints what is left)."""
        self._stopping = True
        self._due.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
