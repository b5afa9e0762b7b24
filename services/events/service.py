"""The event record: listing it, and following it live.

Live watchers are fed from memory: after each commit the store hands over
the event rows it just wrote (with their ids), and, on a store shared by
several processes that tell each other what they record (JetStream,
`others_events_told`), the rows the other processes recorded. Rows are
handed to the watchers in id order: a row above a gap (an id not handed over
yet) is held until the gap fills, for at most GAP_WAIT_S; every watcher
keeps the rows its filter matches in a bounded buffer. A watcher reads the
store instead when it starts behind (replay), when its buffer overflowed,
when a gap did not fill in time (another process on the same store that
tells nothing, a notice lost, a process that died between its write and its
notice), and once per poll interval (another process's events that no row
handed over here follows). A read that such a request overtook does not
count as done: the watcher reads again before it takes from the buffer, or
it would skip the other process's events below the buffered ids. Ids are one
total order, so a watcher never yields an event twice or skips one.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from dataclasses import replace

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from services.clock import now_us
from services.directory import Caller, Directory
from services.store.base import EventQuery, EventRow, EventStore
from services.validation import check_text, fitting, page_size, stored_int

_PAGE = 1000
RUNTIME_KINDS = frozenset(k for k in ev.EventKind.values() if k >= ev.EVENT_KIND_AGENT_SPAWNED)
_BUFFER_LIMIT = 10_000
GAP_WAIT_S = 0.05
"""How long rows above a gap in the ids are held for the other processes' notices to fill it (stores whose
processes tell each other their events), before every watcher reads the store instead."""
_HELD_LIMIT = 10_000
"""Rows held above a gap at most: beyond, the watchers read the store at once."""
EventBatch = list[ev.Event]
"""Events in id order (named here: the service's method `list` hides the builtin inside the class)."""


class _Watcher:
    __slots__ = ("query", "buffer", "needs_store", "rereads", "wake")

    def __init__(self, query: EventQuery):
        self.query = query
        self.buffer: collections.deque[ev.Event] = collections.deque()
        self.needs_store = True
        self.rereads = 0
        """Counts the requests to read the store: a read that one overtook (an event it may not have seen
        was recorded while it ran) does not clear needs_store."""
        self.wake = asyncio.Event()

    def reread(self) -> None:
        """Read the store next: events may have been recorded that the buffer does not hold."""
        self.needs_store = True
        self.rereads += 1
        self.wake.set()

    def matches(self, row: EventRow) -> bool:
        q = self.query
        if q.message_id and row.message_id != q.message_id:
            return False
        if q.sender and row.sender != q.sender:
            return False
        if q.agent_id and q.agent_id != row.agent_id and q.agent_id != row.sender:
            return False
        return not q.kinds or row.kind in q.kinds

    def offer(self, event_id: int, row: EventRow) -> None:
        # Buffer even while a store read is pending: the read may have taken
        # its snapshot before this event committed.
        if len(self.buffer) >= _BUFFER_LIMIT:
            self.buffer.clear()
            self.reread()
        else:
            self.buffer.append(row.event(event_id))
        self.wake.set()


class EventsService:
    def __init__(self, store: EventStore, directory: Directory, *, poll_interval_s: float = 1.0):
        self._store = store
        self._directory = directory
        self._poll_interval_s = poll_interval_s
        self._watchers: set[_Watcher] = set()
        self._last_seen = -1
        """Every event id up to this one was handed to the watchers, or left to their reads of the store."""
        self._held: dict[int, EventRow] = {}
        """Rows above a gap, by id, until it fills."""
        self._gap_wait_s = GAP_WAIT_S if store.others_events_told else 0.0
        self._gap_timer: asyncio.TimerHandle | None = None
        self.gaps_read = 0
        """Gaps that did not fill in time (each made every watcher read the store)."""
        self.closing = False
        self._poll: asyncio.TimerHandle | None = None
        store.add_commit_listener(self._on_commit)

    def _poll_store(self) -> None:
        """Every poll interval, make every watcher re-read the store once:
        the safety net for events written by another process."""
        for watcher in self._watchers:
            watcher.reread()
        self._poll = asyncio.get_running_loop().call_later(self._poll_interval_s, self._poll_store)

    def _on_commit(self, first_id: int, rows: list[EventRow]) -> None:
        if self._last_seen < 0:  # the first rows since start: a watcher's first read may have ended below them
            self._last_seen = first_id - 1
            self._read_store()
        for offset, row in enumerate(rows):
            if first_id + offset > self._last_seen:  # (not below: left to the watchers' reads)
                self._held[first_id + offset] = row
        while self._held:
            row_or_none = self._held.pop(self._last_seen + 1, None)
            if row_or_none is None:
                break
            self._last_seen += 1
            for watcher in self._watchers:
                if watcher.matches(row_or_none):
                    watcher.offer(self._last_seen, row_or_none)
        if not self._held:
            if self._gap_timer is not None:
                self._gap_timer.cancel()
                self._gap_timer = None
        elif self._gap_wait_s <= 0 or len(self._held) > _HELD_LIMIT:
            self._gap_not_filled()
        elif self._gap_timer is None:
            self._gap_timer = asyncio.get_running_loop().call_later(self._gap_wait_s, self._gap_not_filled)

    def _gap_not_filled(self) -> None:
        """The ids below the held rows were not handed over: every watcher reads the store, which has them
        (an id is handed over once its event is stored, and ids are given in order), and the held rows."""
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None
        if not self._held:
            return
        self.gaps_read += 1
        self._last_seen = max(self._held)
        self._held.clear()
        self._read_store()

    def _read_store(self) -> None:
        for watcher in self._watchers:
            watcher.buffer.clear()
            watcher.reread()

    def shutdown(self) -> None:
        self.closing = True
        for timer in (self._poll, self._gap_timer):
            if timer is not None:
                timer.cancel()
        self._poll = self._gap_timer = None
        for watcher in self._watchers:
            watcher.wake.set()

    async def _query(self, caller: Caller, flt: ev.EventFilter, after: int, limit: int) -> EventQuery:
        agent_id, sender = flt.agent_id, flt.sender
        if not caller.is_admin and not agent_id and not sender:
            if flt.message_id:
                sender = caller.require_agent("filtering").agent_id
            else:
                agent_id = caller.require_agent("filtering").agent_id
        for subject in filter(None, (agent_id, sender)):
            record = await self._directory.require(subject)
            self._directory.check_reach(caller, record, "read the events of")
        for kind in flt.kinds:
            if kind not in ev.EventKind.values() or kind == ev.EVENT_KIND_UNSPECIFIED:
                raise errors.InvalidArgument(f"unknown event kind {kind}", reason=Reason.BAD_KIND)
        return EventQuery(
            message_id=flt.message_id, sender=sender, agent_id=agent_id, kinds=tuple(flt.kinds),
            after_event_id=stored_int(after), limit=limit,
        )

    async def record(self, caller: Caller, events: list[ev.Event]) -> list[int]:
        """Runtime events an agent's host reports about that agent."""
        agent = caller.require_agent("recording events")
        if not events:
            raise errors.InvalidArgument("no events to record", reason=Reason.EMPTY_REQUEST)
        if len(events) > _PAGE:
            raise errors.InvalidArgument(f"{len(events)} events in one request; at most {_PAGE}",
                                         reason=Reason.BATCH_TOO_LARGE)
        now = now_us()
        for index, event in enumerate(events):
            if event.kind not in RUNTIME_KINDS:
                kind = ev.EventKind.Name(event.kind) if event.kind in ev.EventKind.values() else event.kind
                raise errors.InvalidArgument(
                    f"event {index}: kind {kind} is not a runtime event; the mesh records message and agent events"
                    " itself",
                    reason=Reason.NOT_A_RUNTIME_EVENT, metadata={"index": str(index)})
            if event.agent_id and event.agent_id != agent.agent_id:
                raise errors.PermissionDenied(
                    f"event {index} is about {event.agent_id}, but the credential is {agent.agent_id}'s: an agent"
                    " records events about itself only", reason=Reason.AGENT_MISMATCH, metadata={"index": str(index)})
            if len(event.detail) > 4096:
                raise errors.InvalidArgument(f"event {index}: detail over 4096 characters",
                                             reason=Reason.FIELD_TOO_LONG)
            for field in ("message_id", "sender", "recipient", "trace_id", "in_reply_to", "conversation_id"):
                check_text(f"event {index}: {field}", getattr(event, field), max_len=256)
            event.sequence, event.turn = stored_int(event.sequence), stored_int(event.turn)
            event.agent_id = agent.agent_id
            event.event_id = 0
            event.at_us = event.at_us or now
        return await self._store.record_events(events, lazy=False)

    async def list(self, caller: Caller, flt: ev.EventFilter, after: int, limit: int) -> list[ev.Event]:
        """A page of matching events after `after`: at most `limit` (default 100, at most 1,000) and at most
        PAGE_BYTES of them (runtime events carry up to 4,096 characters of detail), so a shorter page is
        not the end: the end is an empty page."""
        query = await self._query(caller, flt, after, page_size(limit))
        found = await self._store.list_events(query)
        return found[:fitting(e.ByteSize() for e in found)]

    async def watch(
        self, caller: Caller, flt: ev.EventFilter, after: int, from_now: bool
    ) -> AsyncIterator[EventBatch]:
        """Yield batches of matching events as they are recorded, until shutdown."""
        watcher = _Watcher(await self._query(caller, flt, after, _PAGE))
        self._watchers.add(watcher)
        if self._poll is None and not self.closing:
            self._poll = asyncio.get_running_loop().call_later(self._poll_interval_s, self._poll_store)
        try:
            last = stored_int(after)
            if from_now and not after:  # the store's last id: another process may have recorded events since ours
                last = max(self._last_seen, await self._store.last_event_id())
            while not self.closing:
                watcher.wake.clear()
                if watcher.needs_store:
                    rereads = watcher.rereads
                    found = await self._store.list_events(replace(watcher.query, after_event_id=last))
                    if len(found) < _PAGE and watcher.rereads == rereads:
                        watcher.needs_store = False
                    if found:
                        last = found[-1].event_id
                        yield found
                    continue
                batch = []
                while watcher.buffer:
                    event = watcher.buffer.popleft()
                    if event.event_id > last:
                        batch.append(event)
                if batch:
                    last = batch[-1].event_id
                    yield batch
                    continue
                await watcher.wake.wait()
        finally:
            self._watchers.discard(watcher)
