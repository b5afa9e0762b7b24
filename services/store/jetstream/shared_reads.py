"""Reads that must see NATS as it is now, shared by the callers that want the same key at about the same
time, as the SQLite writer shares a commit: at most one read per key is in flight, and the calls that
come while it is wait for the next one, which starts when it ends. Every caller so gets a read that
began after it asked (a close, an ack, a write made before the call is seen), and sixty-four sends at
once from one agent read its record a few times, not 64 times (`bench/nats_requests.py --in-flight 64`).
A lone call waits for nothing: its read starts at once.

A caller may instead name a moment (`since`, time.monotonic()) after which any read serves it: then a
read of its key begun since, in flight or done, is taken as it is (a send takes the read of its sender
made beside its frontier's, both begun after the mesh took the send's request: services.inbox.service).
The last RECENT_KEPT reads done are kept for that, by the readers made with `recent=True` (the agent copy's)."""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
RECENT_KEPT = 4096
"""Reads done whose values are kept (with when they began) for callers that name a moment."""


class _Recent(Generic[T]):
    """The reads in flight and the last reads done, each with the time.monotonic() it began at."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        """Whether reads are kept at all (only for a user that names moments: no work for the others)."""
        self.flying: dict[str, tuple[float, asyncio.Future[T]]] = {}
        self.done: collections.OrderedDict[str, tuple[float, T]] = collections.OrderedDict()

    def begun(self, key: str, waiting: asyncio.Future[T]) -> None:
        if not self.keep:
            return
        self.flying[key] = (time.monotonic(), waiting)

    def ended(self, key: str, waiting: asyncio.Future[T]) -> None:
        if not self.keep:
            return
        began, _ = self.flying.pop(key, (0.0, None))
        if waiting.cancelled() or waiting.exception() is not None:
            return
        self.done[key] = (began, waiting.result())
        self.done.move_to_end(key)
        while len(self.done) > RECENT_KEPT:
            self.done.popitem(last=False)

    def since(self, key: str, since: float) -> asyncio.Future[T] | None:
        """A read of `key` begun at `since` or later (done: its value as a future), or None."""
        if since == math.inf:
            return None
        flying = self.flying.get(key)
        if flying is not None and flying[0] >= since:
            return flying[1]
        done = self.done.get(key)
        if done is not None and done[0] >= since:
            found: asyncio.Future[T] = asyncio.get_running_loop().create_future()
            found.set_result(done[1])
            return found
        return None


class SharedReads(Generic[T]):
    def __init__(self, read: Callable[[str], Awaitable[T]], seen: Callable[[T], None] | None = None,
                 recent: bool = False):
        self._read = read
        self._seen = seen
        """Called with each value read (before its callers get it)."""
        self._reading: set[str] = set()
        self._next: dict[str, asyncio.Future[T]] = {}
        """Per key, the read the calls that came while one was in flight wait for."""
        self.reads = 0
        """Reads made (each serves every call that waited for it)."""
        self._recent: _Recent[T] = _Recent(recent)
        """`recent`: keep reads for callers that name a moment (`get`'s `since`)."""

    async def get(self, key: str, since: float = math.inf) -> T:
        """A read of `key` begun after this call, or one begun at `since` (time.monotonic()) or later."""
        earlier = self._recent.since(key, since)
        if earlier is not None:
            return await asyncio.shield(earlier)
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
        self._recent.begun(key, result)
        self.reads += 1
        task = asyncio.ensure_future(self._read(key))
        task.add_done_callback(lambda done: self._done(key, result, done))

    def _done(self, key: str, result: asyncio.Future[T], done: asyncio.Future[T]) -> None:
        self._reading.discard(key)
        _hand_over(result, done, lambda value: value, self._seen)
        self._recent.ended(key, result)
        if key in self._next:
            self._start(key)


BATCH_KEYS = 256
"""Keys one batched read asks for at most; more wait for the next."""


class BatchedReads(Generic[T]):
    """Reads of the keys of one bucket shared as SharedReads shares the reads of one key, across keys: at
    most one read is in flight, and the keys asked for while it is, whichever they are, wait for the next,
    which asks for all of them at once (one batched direct get of the bucket: kv.last_many) when it ends.
    Every caller still gets a read that began after it asked; sixty-four sends at once from as many agents
    read their records in a few requests, not 64. A read starts at the loop's next turn, with every key
    asked for in this one (many sends started at once ask one after the other: a read started with the
    first key alone made the others wait for a second one); a lone call waits for that turn only."""

    def __init__(self, read_many: Callable[[list[str]], Awaitable[dict[str, T]]], missing: T,
                 seen: Callable[[T], None] | None = None, recent: bool = False):
        self._read_many = read_many
        """The values of the keys that exist."""
        self._missing = missing
        """The value of a key that does not."""
        self._seen = seen
        self._reading = False
        self._next: dict[str, asyncio.Future[T]] = {}
        """The keys the next read asks for, and where their callers wait."""
        self.reads = 0
        self._recent: _Recent[T] = _Recent(recent)
        """`recent`: keep reads for callers that name a moment (`get`'s `since`)."""

    async def get(self, key: str, since: float = math.inf) -> T:
        """A read of `key` begun after this call, or one begun at `since` (time.monotonic()) or later."""
        earlier = self._recent.since(key, since)
        if earlier is not None:
            return await asyncio.shield(earlier)
        waiting = self._next.get(key)
        if waiting is None:
            waiting = asyncio.get_running_loop().create_future()
            self._next[key] = waiting
            if not self._reading:  # at the loop's next turn: the keys asked for in this one go with it
                self._reading = True
                asyncio.get_running_loop().call_soon(self._start)
        return await asyncio.shield(waiting)

    def _start(self) -> None:
        keys = list(self._next)[:BATCH_KEYS]
        batch = {key: self._next.pop(key) for key in keys}
        for key, waiting in batch.items():
            self._recent.begun(key, waiting)
        self._reading = True
        self.reads += 1
        task = asyncio.ensure_future(self._read_many(keys))
        task.add_done_callback(lambda done: self._done(batch, done))

    def _value(self, key: str, found: dict[str, T]) -> T:
        return found.get(key, self._missing)

    def _done(self, batch: dict[str, asyncio.Future[T]], done: asyncio.Future[dict[str, T]]) -> None:
        self._reading = False
        for key, result in batch.items():
            _hand_over(result, done, functools.partial(self._value, key), self._seen)
            self._recent.ended(key, result)
        if self._next:
            self._start()


def _hand_over(waiting: asyncio.Future[T], done: asyncio.Future[Any], value_of: Callable[[Any], T],
               seen: Callable[[T], None] | None) -> None:
    """Give a read's outcome to the callers waiting on it: its value (value_of the read's result; `seen`
    first), its failure, or its cancellation."""
    if done.cancelled():
        waiting.cancel()
    elif (failure := done.exception()) is not None:
        waiting.set_exception(failure)
        waiting.exception()  # retrieved: a failure every caller gave up on is not logged as lost
    else:
        value = value_of(done.result())
        if seen is not None:
            seen(value)
        waiting.set_result(value)
