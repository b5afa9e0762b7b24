"""The event record: listing and following it. Knows nothing of gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from inboxmesh.events.v1 import events_pb2 as ev
from services import errors
from services.directory import Caller, Directory
from services.store.base import EventQuery, Store
from services.validation import page_size

_WATCH_PAGE = 1000


class EventsService:
    def __init__(self, store: Store, directory: Directory, *, poll_interval_s: float = 1.0):
        self._store = store
        self._directory = directory
        self._poll_interval_s = poll_interval_s
        self._committed = asyncio.Event()
        self.closing = False
        store.add_commit_listener(self._on_commit)

    def _on_commit(self) -> None:
        committed, self._committed = self._committed, asyncio.Event()
        committed.set()

    def shutdown(self) -> None:
        self.closing = True
        self._on_commit()

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
                raise errors.InvalidArgument(f"unknown event kind {kind}", reason="BAD_KIND")
        return EventQuery(
            message_id=flt.message_id, sender=sender, agent_id=agent_id, kinds=tuple(flt.kinds),
            after_event_id=after, limit=limit,
        )

    async def list(self, caller: Caller, flt: ev.EventFilter, after: int, limit: int) -> list[ev.Event]:
        query = await self._query(caller, flt, after, page_size(limit))
        return await self._store.list_events(query)

    async def watch(
        self, caller: Caller, flt: ev.EventFilter, after: int, from_now: bool
    ) -> AsyncIterator[list[ev.Event]]:
        """Yield batches of matching events as they are recorded, forever."""
        query = await self._query(caller, flt, after, _WATCH_PAGE)
        last = after or (await self._store.last_event_id() if from_now else 0)
        while not self.closing:
            committed = self._committed
            events = await self._store.list_events(replace(query, after_event_id=last))
            if events:
                last = events[-1].event_id
                yield events
                continue
            try:
                await asyncio.wait_for(committed.wait(), self._poll_interval_s)
            except TimeoutError:
                pass  # also catches events written by another process
