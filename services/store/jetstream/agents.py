"""Agents and scopes on JetStream: the record (bucket agents, key `a.<agent_id>`) changed by
compare-and-set, index entries by scope, name and parent (one key an entry, `x.<index>.<agent>`), and
what a close sets off (the dead letters of the closed inboxes, the end of their runs, the close of
descendants)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from services.faults import crash_point
from services.store import base
from services.store.base import AGENT_CLOSED, AGENT_OPEN, AgentRecord, CloseOutcome, EventRow
from services.store.jetstream import kv
from services.store.jetstream.connection import JetStreamConnection
from services.store.jetstream.events import EventLog
from services.store.jetstream.inbox import InboxLog
from services.store.jetstream.runs import Runs


def _index_keys(record: AgentRecord) -> list[str]:
    """The indexes naming the agent: its scope's, its name's in the scope, its parent's children."""
    keys = [f"s.{kv.token(record.scope_id)}", f"n.{kv.token(record.scope_id)}.{kv.token(record.name)}"]
    if record.parent_id:
        keys.append(f"c.{kv.token(record.parent_id)}")
    return keys


def _registered_row(record: AgentRecord) -> EventRow:
    return EventRow(record.created_at_us, ev.EVENT_KIND_AGENT_REGISTERED, record.agent_id, sender=record.parent_id,
                    detail=f"name={record.name} mode={record.mode} scope={record.scope_id}")


def _closed_row(agent_id: str, reason: str, at_us: int) -> EventRow:
    return EventRow(at_us, ev.EVENT_KIND_AGENT_CLOSED, agent_id, detail=reason)


def _closing(current: AgentRecord | None, at_us: int, detail: str) -> AgentRecord | None:
    if current is None or current.state != AGENT_OPEN:
        return None
    return replace(current, state=AGENT_CLOSED, closed_at_us=at_us, close_reason=detail)


def _parent_closed(parent_id: str) -> errors.FailedPrecondition:
    return errors.FailedPrecondition(f"parent agent {parent_id} is closed; it cannot have new children",
                                     reason=Reason.AGENT_CLOSED)


class Agents:
    def __init__(self, conn: JetStreamConnection, events: EventLog, inbox: InboxLog, runs: Runs):
        self.conn = conn
        self.events = events
        self.inbox = inbox
        self.runs = runs
        self.cache = inbox.agents
        """Told of every record this process writes or reads (the sends and deliveries here read it)."""

    async def get(self, agent_id: str) -> AgentRecord | None:
        """The record as the bucket holds it now: read after this call began, together with the other
        records asked for at about the same time (AgentCache.fresh: with one replica one batched direct
        get of many agents; with more, one read of the leader an agent). A RegisterChildren of 1,000
        children with request ids made 1,000 reads of one record each to see whether each was registered
        before, and the keeper's roll-forward of their records 1,000 more."""
        return await self.cache.fresh(agent_id)

    async def _index(self, index: str) -> list[str]:
        return await kv.index_members(self.conn, "agents", index)

    async def _index_record(self, record: AgentRecord) -> None:
        await kv.index_add(self.conn, "agents", [(index, record.agent_id) for index in _index_keys(record)])

    async def create(self, record: AgentRecord) -> AgentRecord:
        """Store a new agent: its parent read open (a read shared with the other registrations of the moment,
        AgentCache.fresh), its record created if absent and its index entries written (each shared with the
        other registrations' writes into the bucket: one atomic batch when there are many), then the parent
        read again, at the same time as the index entries: a close that raced the registration closes the
        child too. The registered event last."""
        if record.parent_id:
            parent = await self.cache.fresh(record.parent_id)
            if parent is None:
                raise errors.NotFound(f"parent agent {record.parent_id} does not exist", reason=Reason.AGENT_NOT_FOUND)
            if not parent.is_open:
                raise _parent_closed(record.parent_id)
        created, = await kv.write_many(self.conn, "agents", [(kv.agent_key(record.agent_id), kv.AGENT.encode(record),
                                                              0)])
        if not created:
            raise errors.FailedPrecondition(f"agent {record.agent_id} exists", reason=Reason.AGENT_EXISTS)
        self.cache.learn(record)
        _, parent = await asyncio.gather(self._index_record(record), self._parent_now(record.parent_id))
        if parent is not None and not parent.is_open:  # the parent closed meanwhile: close with it
            await self.close(record.agent_id, f"ancestor {record.parent_id} closed: {parent.close_reason}",
                             parent.closed_at_us)
            raise _parent_closed(record.parent_id)
        await self.events.emit([_registered_row(record)])
        return record

    async def _parent_now(self, parent_id: str) -> AgentRecord | None:
        return await self.cache.fresh(parent_id) if parent_id else None

    async def roll_forward(self, agent_ids: list[str]) -> list[EventRow]:
        """Finish what writing these agents' records started, for a process that
        died midway (the keeper): their index entries; closed with the parent
        when the parent is closed; for a closed agent, its queued messages
        dead-lettered (senders told), its run ended, its open descendants
        closed. Every step can be repeated. The events the records stand for.
        Their index entries: one batched read, then one write of those missing (kv.index_add)."""
        found = await asyncio.gather(*(self.get(a) for a in dict.fromkeys(agent_ids)))
        records = [r for r in found if r is not None]
        await kv.index_add(self.conn, "agents", [(index, record.agent_id) for record in records
                                                 for index in _index_keys(record)], check=True)
        parent_ids = list(dict.fromkeys(r.parent_id for r in records if r.is_open and r.parent_id))
        parents = dict(zip(parent_ids, await asyncio.gather(*(self.get(p) for p in parent_ids))))
        rows: list[EventRow] = []
        for record in records:
            rows.append(_registered_row(record))
            parent = parents.get(record.parent_id) if record.is_open else None
            current: AgentRecord | None = record
            if parent is not None and not parent.is_open:
                await self.close(record.agent_id, f"ancestor {record.parent_id} closed: {parent.close_reason}",
                                 parent.closed_at_us)
                current = await self.get(record.agent_id)
            if current is not None and not current.is_open:
                await self.inbox.dead_letter_all(current.agent_id, base.REASON_CLOSED, current.closed_at_us)
                await self.runs.end_runs_of_closed([current], current.closed_at_us)
                await self.close(current.agent_id, current.close_reason, current.closed_at_us)  # descendants
                rows.append(_closed_row(current.agent_id, current.close_reason, current.closed_at_us))
        return rows

    async def _records(self, ids: list[str], include_closed: bool) -> list[AgentRecord]:
        """The records of an index's agents as the bucket holds them now, in the order the store lists them:
        read together (AgentCache.fresh: with one replica batched direct gets of many agents each, with more
        one read of the leader an agent)."""
        found = await asyncio.gather(*(self.cache.fresh(i) for i in ids))
        return sorted((r for r in found if r is not None and (include_closed or r.is_open)),
                      key=lambda r: (r.created_at_us, r.agent_id))

    async def find(self, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]:
        ids = await self._index(f"n.{kv.token(scope_id)}.{kv.token(name)}")
        return [r for r in await self._records(ids, include_closed) if r.name == name]

    async def list_agents(self, *, scope_id: str, parent_id: str, include_closed: bool, after_key: str,
                          limit: int) -> list[AgentRecord]:
        key = f"c.{kv.token(parent_id)}" if parent_id else f"s.{kv.token(scope_id)}"
        records = await self._records(await self._index(key), include_closed)
        if after_key:
            ids = [r.agent_id for r in records]
            if after_key not in ids:
                raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason=Reason.BAD_PAGE_TOKEN)
            records = records[ids.index(after_key) + 1:]
        return records[:limit]

    async def _descendants(self, agent_id: str) -> list[AgentRecord]:
        """The agent and its open descendants, level by level."""
        first = await self.get(agent_id)
        level = [first] if first is not None else []
        found: list[AgentRecord] = []
        while level:
            found += [r for r in level if r.is_open]
            children = []
            for record in level:
                children += await self._records(await self._index(f"c.{kv.token(record.agent_id)}"), False)
            level = children
        return found

    async def close(self, agent_id: str, reason: str, at_us: int) -> CloseOutcome:
        closed: list[AgentRecord] = []
        rows: list[EventRow] = []
        for agent in await self._descendants(agent_id):
            detail = reason if agent.agent_id == agent_id else f"ancestor {agent_id} closed: {reason}"
            written = await kv.cas(self.conn.agents, kv.agent_key(agent.agent_id),
                                   functools.partial(_closing, at_us=at_us, detail=detail), kv.AGENT)
            if written is None:
                continue  # closed by someone else meanwhile
            self.cache.learn(written)
            closed.append(written)
            rows.append(_closed_row(agent.agent_id, detail, at_us))
        if closed:
            crash_point("closed-unfinished")  # closed, but nothing of what follows a close done yet
        await self.events.emit(rows)
        dead, notices = [], []
        for agent in closed:
            found = await self.inbox.dead_letter_all(agent.agent_id, base.REASON_CLOSED, at_us)
            dead += found[0]
            notices += found[1]
        await self.runs.end_runs_of_closed(closed, at_us)
        return CloseOutcome(closed=closed, dead_lettered=dead, notices=notices)

    async def set_credential(self, agent_id: str, credential_hash: bytes) -> AgentRecord:
        def change(current: AgentRecord | None) -> AgentRecord | None:
            if current is None or current.state != AGENT_OPEN:
                return None
            return replace(current, credential_hash=credential_hash)

        written = await kv.cas(self.conn.agents, kv.agent_key(agent_id), change, kv.AGENT)
        if written is None:
            raise errors.FailedPrecondition(f"agent {agent_id} is closed or unknown; no credential issued",
                                            reason=Reason.AGENT_CLOSED, metadata={"agent_id": agent_id})
        self.cache.learn(written)
        return written
