"""The distributed store: NATS JetStream (docs/jetstream.md).

Inbox messages live on the stream IM_INBOX, one subject per agent
(`im.inbox.<agent_id>`); the stream sequence is the inbox sequence. A
message leaves the stream when it is consumed or dead-lettered, so the
stream's per-subject limit (discard new, per subject) is the inbox capacity
and a full inbox rejects instead of evicting. Everything else is in
key-value buckets, changed by compare-and-set. Events are on IM_EVENTS; the
event id is their stream sequence.

Every decision (duplicate, open/closed, full, which ack wins) is taken
against JetStream inside the call, never against a replica's memory, so any
number of mesh processes can share one NATS.

This class only assembles the parts, one per concern, over one shared
connection (connection.py): agents, inbox (with messages), runs and
sessions, events, and the keeper. Each public method requires the store to
be open and translates NATS failures into Unavailable (`@nats_call`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from inboxmesh.client import errors
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2
from services.config import StoreConfig
from services.store import base
from services.store.base import (
    AckOutcome,
    AgentRecord,
    AnnounceOutcome,
    AppendItem,
    CloseOutcome,
    Closes,
    CommitListener,
    DeliveryBatch,
    EventQuery,
    EventRecord,
    Frontier,
    MessageRecord,
    OutboxAdded,
    OutboxEntry,
    RunRecord,
    RunWork,
    SendOutcome,
    SpawnLimits,
)
from services.store.jetstream.agent_cache import AgentCache
from services.store.jetstream.agents import Agents
from services.store.jetstream.closes import CloseFollower
from services.store.jetstream.connection import JetStreamConnection, nats_call
from services.store.jetstream.events import EventLog
from services.store.jetstream.inbox import InboxLog
from services.store.jetstream.keeper import EventKeeper
from services.store.jetstream.outbox import Outbox
from services.store.jetstream.runs import Runs
from services.store.jetstream.sessions import Sessions
from services.store.ordering import append_in_order


class JetStreamStore(base.Store):
    fresh_delivery = False
    others_events_told = True

    def __init__(self, config: StoreConfig):
        self.config = config
        self.conn = JetStreamConnection(config)
        self.events = EventLog(self.conn)
        self.agent_cache = AgentCache(self.conn)
        self.inbox = InboxLog(self.conn, self.events, self.agent_cache)
        self.runs = Runs(self.conn, self.events, self.inbox)
        self.agents = Agents(self.conn, self.events, self.inbox, self.runs)
        self.sessions = Sessions(self.conn, self.agents, self.runs)
        self.keeper = EventKeeper(self.conn, self.events, self.agents, self.runs)
        self.closes = CloseFollower(self.conn)
        self.outbox = Outbox(self.conn)

    # -- lifecycle ------------------------------------------------------------
    @nats_call
    async def start(self) -> None:
        await self.conn.open()
        self.agent_cache.start()
        await self.events.start()
        await self.inbox.start()
        self.keeper.start()

    def on_lost(self, callback: Callable[[str], None]) -> None:
        self.conn.on_lost = callback

    @nats_call
    async def close(self) -> None:
        await self.keeper.stop()
        await self.agent_cache.stop()
        await self.inbox.flush_marks()
        await self.closes.drop()
        await self.events.drain()
        await self.conn.close()

    # -- agents (agents.py) -----------------------------------------------------------
    @nats_call
    async def create_agent(self, record: AgentRecord) -> AgentRecord:
        self.conn.require_open()
        return await self.agents.create(record)

    @nats_call
    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        self.conn.require_open()
        return await self.agents.get(agent_id)

    @nats_call
    async def find_agents(self, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]:
        self.conn.require_open()
        return await self.agents.find(scope_id, name, include_closed)

    @nats_call
    async def list_agents(self, *, scope_id: str = "", parent_id: str = "", include_closed: bool, after_key: str,
                          limit: int) -> list[AgentRecord]:
        self.conn.require_open()
        return await self.agents.list_agents(scope_id=scope_id, parent_id=parent_id, include_closed=include_closed,
                                             after_key=after_key, limit=limit)

    @nats_call
    async def close_agent(self, agent_id: str, reason: str, at_us: int) -> CloseOutcome:
        self.conn.require_open()
        return await self.agents.close(agent_id, reason, at_us)

    @nats_call
    async def set_credential(self, agent_id: str, credential_hash: bytes) -> AgentRecord:
        self.conn.require_open()
        return await self.agents.set_credential(agent_id, credential_hash)

    # -- runs and sessions (runs.py, sessions.py) -----------------------------------------
    @nats_call
    async def create_child(self, record: AgentRecord, run: RunRecord, limits: SpawnLimits, *,
                           resume: bool = False) -> AgentRecord:
        self.conn.require_open()
        return await self.sessions.create_child(record, run, limits, resume=resume)

    @nats_call
    async def get_run(self, *, run_id: str = "", child_id: str = "") -> RunRecord | None:
        self.conn.require_open()
        return await self.runs.get(run_id=run_id, child_id=child_id)

    @nats_call
    async def list_runs(self, requester_id: str, include_archived: bool, after_key: str,
                        limit: int) -> list[RunRecord]:
        self.conn.require_open()
        return await self.runs.list_runs(requester_id, include_archived, after_key, limit)

    @nats_call
    async def end_run(self, run_id: str, status: int, result: str, at_us: int,
                      traceparent: str = "") -> tuple[RunRecord, bool]:
        self.conn.require_open()
        return await self.runs.end(run_id, status, result, at_us, traceparent)

    @nats_call
    async def announce_run(self, run_id: str, at_us: int) -> AnnounceOutcome:
        self.conn.require_open()
        return await self.runs.announce(run_id, at_us)

    @nats_call
    async def finish_cleanup(self, run_id: str, detail: str, at_us: int) -> RunRecord:
        self.conn.require_open()
        return await self.runs.finish_cleanup(run_id, detail, at_us)

    @nats_call
    async def archive_run(self, run_id: str, at_us: int) -> RunRecord:
        self.conn.require_open()
        return await self.runs.archive(run_id, at_us)

    @nats_call
    async def run_work(self, now_us: int, limit: int) -> RunWork:
        self.conn.require_open()
        return await self.runs.work(now_us, limit)

    @nats_call
    async def session_agent(self, session_key: str, new_agent: AgentRecord) -> tuple[AgentRecord, bool]:
        self.conn.require_open()
        return await self.sessions.session_agent(session_key, new_agent)

    # -- inbox (inbox.py, messages.py) ----------------------------------------------------
    def add_append_listener(self, callback: Callable[[str], None]) -> None:
        self.inbox.listeners.append(callback)

    @nats_call
    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        self.conn.require_open()
        return await self.inbox.append(sender_id, items, at_us)

    async def append_groups(self, groups: list[tuple[str, list[AppendItem]]],
                            at_us: int) -> list[list[SendOutcome]]:
        if self.inbox.entries_in_turn(groups):
            # concurrent appends finish in any order: each group waits for the ones it must follow
            return await append_in_order(self.append, groups, at_us)
        return await self._append_many(groups, at_us)

    @nats_call
    async def _append_many(self, groups: list[tuple[str, list[AppendItem]]],
                           at_us: int) -> list[list[SendOutcome]]:
        self.conn.require_open()
        return await self.inbox.append_many(groups, at_us)

    @nats_call
    async def next_deliveries(self, recipient: str, after_sequence: int, limit: int, max_attempts: int,
                              now_us: int, in_flight: int = 0) -> DeliveryBatch:
        self.conn.require_open()
        return await self.inbox.next_deliveries(recipient, after_sequence, limit, max_attempts, now_us, in_flight)

    @nats_call
    async def closes_since(self, cursor: int | None, limit: int) -> Closes:
        self.conn.require_open()
        return await self.closes.closes_since(cursor, limit)

    async def mark_delivered(self, recipient: str, envelopes: list[envelope_pb2.Envelope],
                             at_us: int) -> asyncio.Future[Any]:
        raise errors.Internal("the jetstream store delivers from the stream only (no in-memory fast path)")

    async def ack(self, recipient: str, sequences: list[int], at_us: int, turn: int = 0) -> list[AckOutcome]:
        return (await self.ack_many([(recipient, sequences, turn)], at_us))[0]

    @nats_call
    async def ack_many(self, entries: list[tuple[str, list[int], int]], at_us: int) -> list[list[AckOutcome]]:
        self.conn.require_open()
        answers = await self.inbox.ack_many(entries, at_us)
        consumed: dict[str, list[str]] = {}
        for (recipient, _, _), outcomes in zip(entries, answers):
            ids = [o.message_id for o in outcomes if o.status == inbox_pb2.ACK_STATUS_CONSUMED]
            if ids:
                consumed.setdefault(recipient, []).extend(ids)
        await asyncio.gather(*(self.runs.mark_started(recipient, ids, at_us) for recipient, ids in consumed.items()))
        return answers

    @nats_call
    async def get_frontier(self, agent_id: str) -> Frontier | None:
        """The frontier, and beside it (pipelined, one round trip for both) the agent's record as the bucket
        holds it now: asked for by a send before its append, which takes that read of its sender
        (AppendItem.taken_at) instead of making its own one round trip later."""
        self.conn.require_open()
        frontier, _ = await asyncio.gather(self.inbox.frontier(agent_id), self.inbox.agents.fresh(agent_id))
        return frontier

    # -- the IOA outbox (outbox.py) ---------------------------------------------------
    @nats_call
    async def outbox_add(self, entries: list[OutboxEntry], limit: int) -> list[OutboxAdded]:
        self.conn.require_open()
        return await self.outbox.add(entries, limit)

    @nats_call
    async def outbox_list(self, after: int, limit: int) -> list[OutboxEntry]:
        self.conn.require_open()
        return await self.outbox.entries(after, limit)

    @nats_call
    async def outbox_remove(self, entries: list[OutboxEntry]) -> None:
        self.conn.require_open()
        await self.outbox.remove(entries)

    @nats_call
    async def get_message_by_sender(self, sender: str, message_id: str) -> MessageRecord | None:
        self.conn.require_open()
        return await self.inbox.by_sender(sender, message_id)

    @nats_call
    async def get_message_by_inbox(self, recipient: str, sequence: int) -> MessageRecord | None:
        self.conn.require_open()
        return await self.inbox.by_inbox(recipient, sequence)

    @nats_call
    async def list_dead_letters(self, *, recipient: str = "", sender: str = "", after_key: str,
                                limit: int) -> tuple[list[MessageRecord], str]:
        self.conn.require_open()
        return await self.inbox.dead_letters(recipient=recipient, sender=sender, after_key=after_key, limit=limit)

    # -- events (events.py) ----------------------------------------------------------------
    def add_commit_listener(self, callback: CommitListener) -> None:
        self.events.listeners.append(callback)

    @nats_call
    async def record_events(self, events: list[EventRecord], *, lazy: bool = True) -> list[int]:
        self.conn.require_open()
        return await self.events.record(events, lazy=lazy)

    @nats_call
    async def last_event_id(self) -> int:
        self.conn.require_open()
        return await self.events.last_event_id()

    @nats_call
    async def list_events(self, query: EventQuery) -> list[EventRecord]:
        self.conn.require_open()
        return await self.events.read(query)
