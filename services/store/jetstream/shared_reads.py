"""Reads that must see NATS as it is now, shared by the callers that want the same key at about the same
time, as the SQLite writer shares a commit: at most one read per key is in flight, and the calls that
come while it is wait for the next one, which starts when it ends. Every caller so gets a read that
began after it asked (a close, an ack, a write made before the call is seen), and sixty-four sends at
once from one agent read its record a few times, not 64 times (`bench/nats_requests.py --in-flight 64`).
A lone call waits for nothing: its read starts at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedReads(Generic[T]):
    def __init__(self, read: Callable[[str], Awaitable[T]], seen: Callable[[T], None] | None = None):
        self._read = read
        self._seen = seen
        """Called with each value read (before its callers get it)."""
        self._reading: set[str] = set()
        self._next: dict[str, asyncio.Future[T]] = {}
        """Per key, the read the calls that came while one was in flight wait for."""
        self.reads = 0
        """Reads made (each serves every call that waited for it)."""

    async def get(self, key: str) -> T:
        waiting = self._next.get(key)
        if waiting is None:
            waiting = asyncio.get_running_loop().create_future()
            self._next[key] = waiting
            if key not in self._reading:
                self._start(key)
        return await asyncio.shield(waiting)

    def _start(self, key: str) -> None:
        result = self._next.pop(key)
        self._reading.add(key)
        self.reads += 1
        task = asyncio.ensure_future(self._read(key))
        task.add_done_callback(lambda done: self._done(key, result, done))

    def _done(self, key: str, result: asyncio.Future[T], done: asyncio.Future[T]) -> None:
        self._reading.discard(key)
        if done.cancelled():
            result.cancel()
        elif (failure := done.exception()) is not None:
            result.set_exception(failure)
            result.exception()  # retrieved: a failure every caller gave up on is not logged as lost
        else:
            value = done.result()
            if self._seen is not None:
                self._seen(value)
            result.set_result(value)
        if key in self._next:
            self._start(key)
