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
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import nats
import nats.errors
from nats.js.api import DiscardPolicy, KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import APIError as NatsApiError
from nats.js.errors import BadRequestError, NoKeysError, NotFoundError

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.runs.v1 import runs_pb2
from services.config import StoreConfig
from services.faults import crash_point
from services.store import base
from services.store.base import (
    AGENT_CLOSED,
    ANNOUNCE_PENDING,
    ANNOUNCED,
    REQUESTER_GONE,
    AgentRecord,
    AnnounceOutcome,
    EventQuery,
    RunRecord,
    RunWork,
    SpawnLimits,
)
from services.store.jetstream import kv as kvh
from services.store.jetstream.inbox import InboxLog
from services.store.jetstream.keeper import EVENT_DEDUP_WINDOW_S, EventKeeper, dedup_id
from services.store.run_rules import (
    STATUS_NAME,
    announce_envelope,
    announce_events,
    end,
    keep_if_kept,
    run_event,
    settle,
)

log = logging.getLogger(__name__)
BUCKETS = ("agents", "msgs", "runs", "runwork", "misc")
"""runwork: one key per run not archived yet, so the sweeper reads only those."""


class JetStreamStore(base.Store):
    fresh_delivery = False

    def __init__(self, config: StoreConfig):
        self.config = config
        ns = config.nats_namespace
        if not ns.isidentifier() or not ns.isascii():
            raise errors.InvalidArgument(f"nats namespace {ns!r}: letters, digits and _ only", reason=Reason.BAD_CONFIG)
        self.ns = ns
        self.inbox_stream = f"{ns.upper()}_INBOX"
        self.event_stream = f"{ns.upper()}_EVENTS"
        self.nc: nats.NATS | None = None
        self.js = None
        self.kv: dict[str, object] = {}
        self.inbox: InboxLog | None = None
        self._listeners: list[Callable[[int, list[tuple]], None]] = []
        self._append_listeners: list[Callable] = []
        self._pending_events: set[asyncio.Task] = set()
        self._subscription = None
        self.keeper: EventKeeper | None = None
        self._settled_starts: set[str] = set()
        """Agents whose run has started, or that have none: acks need no run lookup."""

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        urls = list(self.config.nats_urls)
        if not urls:
            raise errors.InvalidArgument("the jetstream store needs NATS server URLs (--nats)", reason=Reason.BAD_CONFIG)
        try:
            self.nc = await nats.connect(servers=urls, connect_timeout=5, max_reconnect_attempts=-1,
                                         reconnect_time_wait=0.2, name="inboxmesh")
        except Exception as exc:
            raise errors.Unavailable(f"cannot reach NATS at {', '.join(urls)}: {exc}", reason=Reason.NATS_DOWN) from None
        self.js = self.nc.jetstream(timeout=self.config.nats_timeout_s)
        replicas = self.config.nats_replicas
        ns = self.ns
        await self._ensure_stream(StreamConfig(
            name=self.inbox_stream, subjects=[f"{ns}.inbox.*"], storage=StorageType.FILE, num_replicas=replicas,
            max_msgs_per_subject=self.config.max_inbox_capacity, discard=DiscardPolicy.NEW,
            discard_new_per_subject=True, duplicate_window=self.config.nats_duplicate_window_s, allow_direct=True))
        await self._ensure_stream(StreamConfig(
            name=self.event_stream, subjects=[f"{ns}.ev.>"], storage=StorageType.FILE, num_replicas=replicas,
            allow_direct=True, duplicate_window=EVENT_DEDUP_WINDOW_S))
        for bucket in BUCKETS:
            self.kv[bucket] = await self.js.create_key_value(KeyValueConfig(
                bucket=f"{ns}_{bucket}", history=1, storage=StorageType.FILE, replicas=replicas))
        self.inbox = InboxLog(self)
        self.inbox.listeners = self._append_listeners
        self._subscription = await self.nc.subscribe(f"{ns}.inbox.*", cb=self.inbox.on_published)
        self.keeper = EventKeeper(self)
        self.keeper.start()
        log.info("jetstream store on %s (replicas=%d)", ", ".join(urls), replicas)

    async def _ensure_stream(self, config: StreamConfig) -> None:
        try:
            await self.js.add_stream(config)
        except BadRequestError:
            await self.js.update_stream(config)

    async def close(self) -> None:
        if self.keeper is not None:
            await self.keeper.stop()
        if self._pending_events:
            await asyncio.gather(*self._pending_events, return_exceptions=True)
        nc, self.nc = self.nc, None
        if nc is not None:
            await nc.drain()

    @property
    def agents(self):
        return self.kv["agents"]

    @property
    def msgs(self):
        return self.kv["msgs"]

    @property
    def runs(self):
        return self.kv["runs"]

    @property
    def misc(self):
        return self.kv["misc"]

    def require_open(self) -> None:
        if self.nc is None or self.js is None:
            raise errors.Unavailable("the store is not running", reason=Reason.STORE_CLOSED)

    # -- events ---------------------------------------------------------------
    async def emit(self, rows: list[tuple]) -> list[int]:
        """Publish event rows, in order; ids (stream sequences) once stored."""
        return [ack.seq for ack in await self.publish_events(rows)]

    async def publish_events(self, rows: list[tuple]) -> list:
        """Publish event rows in order (pipelined) and tell this process's
        listeners of the new ones; the PubAcks. A message event carries its
        identity (dedup_id) as Nats-Msg-Id, so a copy the event keeper
        publishes again is dropped (ack.duplicate)."""
        if not rows:
            return []
        futures = []
        for row in rows:
            ident = dedup_id(row)
            futures.append(await self.js.publish_async(
                f"{self.ns}.ev.{kvh.token(row[2] or '_')}.{kvh.token(row[4] or '_')}",
                base.event_of(0, row).SerializeToString(), headers={"Nats-Msg-Id": ident} if ident else None))
        try:
            acks = await asyncio.wait_for(asyncio.gather(*futures), self.config.nats_timeout_s)
        except TimeoutError:
            for future in futures:
                future.cancel()
            raise nats.errors.TimeoutError from None
        for ack, row in zip(acks, rows):
            if ack.duplicate:
                continue
            for callback in self._listeners:
                try:
                    callback(ack.seq, [row])
                except Exception:
                    log.exception("event listener failed")
        return acks

    def emit_later(self, rows: list[tuple]) -> None:
        task = asyncio.create_task(self.emit(rows))
        self._pending_events.add(task)
        task.add_done_callback(self._pending_events.discard)

    async def record_events(self, events: list[ev.Event], *, lazy: bool = True) -> list[int]:
        self.require_open()
        rows = [base.event_row(e.at_us, e.kind, e.agent_id, message_id=e.message_id, sender=e.sender,
                               recipient=e.recipient, seq=e.sequence, detail=e.detail, trace_id=e.trace_id,
                               turn=e.turn, in_reply_to=e.in_reply_to, conversation_id=e.conversation_id)
                for e in events]
        if lazy:
            self.emit_later(rows)
            return []
        return await self.emit(rows)

    def add_commit_listener(self, callback) -> None:
        self._listeners.append(callback)

    def add_append_listener(self, callback) -> None:
        self._append_listeners.append(callback)

    async def last_event_id(self) -> int:
        self.require_open()
        return (await self.js.stream_info(self.event_stream)).state.last_seq

    async def list_events(self, query: EventQuery) -> list[ev.Event]:
        self.require_open()
        if query.agent_id:
            token = kvh.token(query.agent_id)
            subjects = [f"{self.ns}.ev.{token}.*", f"{self.ns}.ev.*.{token}"]
        elif query.sender:
            subjects = [f"{self.ns}.ev.*.{kvh.token(query.sender)}"]
        else:
            subjects = [f"{self.ns}.ev.>"]
        found: dict[int, ev.Event] = {}
        for subject in subjects:
            seq = query.after_event_id + 1
            while len(found) < query.limit * len(subjects):
                try:
                    msg = await self.js.get_msg(self.event_stream, seq=seq, subject=subject, next=True, direct=True)
                except NotFoundError:
                    break
                event = ev.Event.FromString(msg.data)
                event.event_id = msg.seq
                if _matches(event, query):
                    found[msg.seq] = event
                seq = msg.seq + 1
        return [found[k] for k in sorted(found)][:query.limit]

    # -- registry -------------------------------------------------------------
    async def get_agent(self, agent_id: str) -> AgentRecord | None:
        self.require_open()
        found = await kvh.get(self.agents, f"a.{kvh.token(agent_id)}")
        return kvh.agent_of(found[0]) if found else None

    async def _index_add(self, key: str, value: str) -> None:
        await kvh.cas(self.agents, key, lambda cur: None if cur and value in cur else [*(cur or []), value])

    async def _index(self, key: str) -> list[str]:
        found = await kvh.get(self.agents, key)
        return found[0] if found else []

    async def create_agent(self, record: AgentRecord) -> AgentRecord:
        self.require_open()
        if record.parent_id:
            parent = await self.get_agent(record.parent_id)
            if parent is None:
                raise errors.NotFound(f"parent agent {record.parent_id} does not exist", reason=Reason.AGENT_NOT_FOUND)
            if not parent.is_open:
                raise errors.FailedPrecondition(
                    f"parent agent {record.parent_id} is closed; it cannot have new children", reason=Reason.AGENT_CLOSED)
        if not await kvh.create(self.agents, f"a.{kvh.token(record.agent_id)}", kvh.agent_json(record)):
            raise errors.FailedPrecondition(f"agent {record.agent_id} exists", reason=Reason.AGENT_EXISTS)
        await self._index_add(f"s.{kvh.token(record.scope_id)}", record.agent_id)
        await self._index_add(f"n.{kvh.token(record.scope_id)}.{kvh.token(record.name)}", record.agent_id)
        if record.parent_id:
            await self._index_add(f"c.{kvh.token(record.parent_id)}", record.agent_id)
            parent = await self.get_agent(record.parent_id)
            if parent is not None and not parent.is_open:  # the parent closed meanwhile: close with it
                await self.close_agent(record.agent_id, f"ancestor {record.parent_id} closed: {parent.close_reason}",
                                       parent.closed_at_us)
                raise errors.FailedPrecondition(
                    f"parent agent {record.parent_id} is closed; it cannot have new children", reason=Reason.AGENT_CLOSED)
        await self.emit([_registered_row(record)])
        return record

    async def roll_forward_agent(self, agent_id: str) -> list[tuple]:
        """Finish what writing this agent's record started, for a process that
        died midway (the keeper): its index entries; closed with its parent
        when the parent is closed; for a closed agent, its queued messages
        dead-lettered (senders told), its run ended, its open descendants
        closed. Every step can be repeated. The events the record stands for."""
        record = await self.get_agent(agent_id)
        if record is None:
            return []
        await self._index_add(f"s.{kvh.token(record.scope_id)}", record.agent_id)
        await self._index_add(f"n.{kvh.token(record.scope_id)}.{kvh.token(record.name)}", record.agent_id)
        if record.parent_id:
            await self._index_add(f"c.{kvh.token(record.parent_id)}", record.agent_id)
        rows = [_registered_row(record)]
        if record.is_open and record.parent_id:
            parent = await self.get_agent(record.parent_id)
            if parent is not None and not parent.is_open:
                await self.close_agent(record.agent_id, f"ancestor {record.parent_id} closed: {parent.close_reason}",
                                       parent.closed_at_us)
                record = await self.get_agent(agent_id)
        if record is not None and not record.is_open:
            await self.inbox.dead_letter_all(record.agent_id, base.REASON_CLOSED, record.closed_at_us)
            await self._end_runs_of_closed([record], record.closed_at_us)
            await self.close_agent(record.agent_id, record.close_reason, record.closed_at_us)  # descendants
            rows.append(_closed_row(record.agent_id, record.close_reason, record.closed_at_us))
        return rows

    async def roll_forward_run(self, run_id: str) -> list[tuple]:
        """Finish what writing this run record started (the keeper): its
        index entries and its place among the sweeper's work; the events its
        state stands for."""
        run = await self.get_run(run_id=run_id)
        if run is None:
            return []
        await self._index_run(run)
        rows: list[tuple] = []
        run_event(rows, run, ev.EVENT_KIND_RUN_CREATED, run.created_at_us, detail=run.label or run.task[:200])
        if run.started_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_STARTED, run.started_at_us)
        if run.ended_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_ENDED, run.ended_at_us, detail=STATUS_NAME[run.status])
        if run.announce_state == ANNOUNCED:
            run_event(rows, run, ev.EVENT_KIND_RUN_ANNOUNCED, run.announced_at_us, detail=run.announce_detail,
                      seq=run.announce_sequence)
        elif run.announce_state == REQUESTER_GONE:
            run_event(rows, run, ev.EVENT_KIND_RUN_REQUESTER_GONE, run.announced_at_us, detail=run.announce_detail)
        if run.cleaned_up_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_CLEANED_UP, run.cleaned_up_at_us)
        if run.archived_at_us:
            run_event(rows, run, ev.EVENT_KIND_RUN_ARCHIVED, run.archived_at_us)
        return rows

    async def _records(self, ids: list[str], include_closed: bool) -> list[AgentRecord]:
        found = await asyncio.gather(*(self.get_agent(i) for i in ids))
        return sorted((r for r in found if r is not None and (include_closed or r.is_open)),
                      key=lambda r: (r.created_at_us, r.agent_id))

    async def find_agents(self, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]:
        self.require_open()
        ids = await self._index(f"n.{kvh.token(scope_id)}.{kvh.token(name)}")
        return [r for r in await self._records(ids, include_closed) if r.name == name]

    async def list_agents(self, *, scope_id: str = "", parent_id: str = "", include_closed: bool, after_key: str,
                          limit: int) -> list[AgentRecord]:
        self.require_open()
        key = f"c.{kvh.token(parent_id)}" if parent_id else f"s.{kvh.token(scope_id)}"
        records = await self._records(await self._index(key), include_closed)
        if after_key:
            ids = [r.agent_id for r in records]
            if after_key not in ids:
                raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason=Reason.BAD_PAGE_TOKEN)
            records = records[ids.index(after_key) + 1:]
        return records[:limit]

    async def _descendants(self, agent_id: str) -> list[AgentRecord]:
        """The agent and its open descendants, level by level."""
        first = await self.get_agent(agent_id)
        level = [first] if first is not None else []
        found: list[AgentRecord] = []
        while level:
            found += [r for r in level if r.is_open]
            children = []
            for record in level:
                children += await self._records(await self._index(f"c.{kvh.token(record.agent_id)}"), False)
            level = children
        return found

    async def close_agent(self, agent_id: str, reason: str, at_us: int) -> base.CloseOutcome:
        self.require_open()
        closed: list[AgentRecord] = []
        rows: list[tuple] = []
        for agent in await self._descendants(agent_id):
            detail = reason if agent.agent_id == agent_id else f"ancestor {agent_id} closed: {reason}"

            def change(current):
                if current is None or current["state"] != base.AGENT_OPEN:
                    return None
                return {**current, "state": AGENT_CLOSED, "closed_at_us": at_us, "close_reason": detail}

            written = await kvh.cas(self.agents, f"a.{kvh.token(agent.agent_id)}", change)
            if written is None:
                continue  # closed by someone else meanwhile
            closed.append(kvh.agent_of(written))
            rows.append(_closed_row(agent.agent_id, detail, at_us))
        if closed:
            crash_point("closed-unfinished")  # closed, but nothing of what follows a close done yet
        await self.emit(rows)
        dead, notices = [], []
        for agent in closed:
            found = await self.inbox.dead_letter_all(agent.agent_id, base.REASON_CLOSED, at_us)
            dead += found[0]
            notices += found[1]
        await self._end_runs_of_closed(closed, at_us)
        return base.CloseOutcome(closed=closed, dead_lettered=dead, notices=notices)

    async def set_credential(self, agent_id: str, credential_hash: bytes) -> AgentRecord:
        self.require_open()

        def change(current):
            if current is None or current["state"] != base.AGENT_OPEN:
                return None
            return {**current, "credential_hash": credential_hash.hex()}

        written = await kvh.cas(self.agents, f"a.{kvh.token(agent_id)}", change)
        if written is None:
            raise errors.FailedPrecondition(f"agent {agent_id} is closed or unknown; no credential issued",
                                            reason=Reason.AGENT_CLOSED, metadata={"agent_id": agent_id})
        return kvh.agent_of(written)

    async def session_agent(self, session_key: str, new_agent: AgentRecord) -> tuple[AgentRecord, bool]:
        self.require_open()
        key = f"session.{kvh.token(session_key)}"
        registered = False
        for _ in range(kvh.MAX_CAS_TRIES):
            found = await kvh.get(self.misc, key)
            current = found[0] if found else None
            if current:
                agent = await self.get_agent(current)
                if agent is not None and agent.is_open:
                    if registered:  # another process's agent won the session
                        await self.close_agent(new_agent.agent_id, "lost a race for its session",
                                               new_agent.created_at_us)
                    return agent, False
            if not registered:  # no agent yet, or a closed one: the session starts anew
                await self.create_agent(new_agent)
                registered = True
            if await kvh.cas(self.misc, key, lambda cur, seen=current: new_agent.agent_id if cur == seen else None):
                return new_agent, True
        raise errors.Unavailable(f"too much contention on session {session_key}", reason=Reason.CONTENTION)

    # -- inbox (services.store.jetstream_inbox) ---------------------------------------
    async def append(self, sender_id, items, at_us):
        self.require_open()
        return await self.inbox.append(sender_id, items, at_us)

    async def next_deliveries(self, recipient, after_sequence, limit, max_attempts, now_us, in_flight=0):
        self.require_open()
        return await self.inbox.next_deliveries(recipient, after_sequence, limit, max_attempts, now_us, in_flight)

    async def mark_delivered(self, recipient, envelopes, at_us):
        raise errors.Internal("the jetstream store delivers from the stream only (no in-memory fast path)")


    async def ack(self, recipient, sequences, at_us, turn=0):
        self.require_open()
        outcomes = await self.inbox.ack(recipient, sequences, at_us, turn)
        consumed = [o.message_id for o in outcomes if o.status == inbox_pb2.ACK_STATUS_CONSUMED]
        if consumed:
            await self._mark_started(recipient, consumed, at_us)
        return outcomes

    async def get_frontier(self, agent_id):
        self.require_open()
        return await self.inbox.frontier(agent_id)

    async def get_message_by_sender(self, sender, message_id):
        self.require_open()
        return await self.inbox.by_sender(sender, message_id)

    async def get_message_by_inbox(self, recipient, sequence):
        self.require_open()
        return await self.inbox.by_inbox(recipient, sequence)

    async def list_dead_letters(self, *, recipient="", sender="", after_key, limit):
        self.require_open()
        return await self.inbox.dead_letters(recipient=recipient, sender=sender, after_key=after_key, limit=limit)

    # -- subagent runs ----------------------------------------------------------------
    def _run_key(self, run_id: str) -> str:
        return f"r.{kvh.token(run_id)}"

    async def _load_run(self, key: str) -> tuple[RunRecord, int] | None:
        try:
            entry = await self.runs.get(key)
        except Exception:
            return None
        if not entry.value:
            return None
        return RunRecord.FromString(entry.value), entry.revision

    async def _change_run(self, run_id: str, change: Callable[[RunRecord, list[tuple]], bool]) -> RunRecord:
        """Apply `change` (which returns False to leave the run as it is) by
        compare-and-set; emit the events of the change that won."""
        for _ in range(kvh.MAX_CAS_TRIES):
            found = await self._load_run(self._run_key(run_id))
            if found is None:
                raise errors.NotFound(f"no run {run_id}", reason=Reason.RUN_NOT_FOUND, metadata={"run_id": run_id})
            run, revision = found
            rows: list[tuple] = []
            if not change(run, rows):
                return run
            try:
                await self.runs.update(self._run_key(run_id), run.SerializeToString(), last=revision)
            except Exception:
                continue
            await self.emit(rows)
            return run
        raise errors.Unavailable(f"too much contention on run {run_id}", reason=Reason.CONTENTION)

    async def create_child(self, record: AgentRecord, run: RunRecord, limits: SpawnLimits, *,
                           resume: bool = False) -> AgentRecord:
        """The child's slot among its parent's active children, the agent,
        then its run: every step can be repeated, so a retry after a crash
        in between (resume) completes it."""
        self.require_open()
        if record.depth > limits.max_depth:
            raise errors.ResourceExhausted(
                f"spawn refused: {record.name!r} would be at depth {record.depth}; the most is {limits.max_depth}",
                reason=Reason.SPAWN_DEPTH, metadata={"depth": str(record.depth), "max_depth": str(limits.max_depth)})
        slots = f"active.{kvh.token(record.parent_id)}"
        refused: list[int] = []

        def take(current):
            active = current or []
            if record.agent_id in active:
                return None  # taken by an earlier attempt
            if len(active) >= limits.max_active_children:
                refused.append(len(active))
                return None
            return [*active, record.agent_id]

        await kvh.cas(self.misc, slots, take)
        if refused:
            raise errors.ResourceExhausted(
                f"spawn refused: {record.parent_id} already has {refused[-1]} running children; the most is"
                f" {limits.max_active_children} (wait for one to finish)",
                reason=Reason.TOO_MANY_CHILDREN, metadata={"active": str(refused[-1]),
                                                      "max": str(limits.max_active_children)})
        if not resume:
            try:
                await self.create_agent(record)
            except BaseException:
                await self._release_slot(record.parent_id, record.agent_id)
                raise
            crash_point("child-stored")  # the agent is stored, its run not yet
        created = await kvh.create(self.runs, self._run_key(run.run_id), run.SerializeToString(), raw=True)
        await self._index_run(run)
        if created:
            rows: list[tuple] = []
            run_event(rows, run, ev.EVENT_KIND_RUN_CREATED, run.created_at_us, detail=run.label or run.task[:200])
            await self.emit(rows)
        return record

    async def _index_run(self, run: RunRecord) -> None:
        """The run's index entries (by child, by requester) and, until it is
        archived, its place among the sweeper's work; each can be repeated."""
        await kvh.cas(self.runs, f"c.{kvh.token(run.child_id)}", lambda cur: run.run_id if cur is None else None)
        await kvh.cas(self.runs, f"q.{kvh.token(run.requester_id)}",
                      lambda cur: None if cur and run.run_id in cur else [*(cur or []), run.run_id])
        if not run.archived_at_us:
            await self.kv["runwork"].put(kvh.token(run.run_id), b"")

    async def _release_slot(self, parent_id: str, child_id: str) -> None:
        await kvh.cas(self.misc, f"active.{kvh.token(parent_id)}",
                      lambda cur: [c for c in cur if c != child_id] if cur and child_id in cur else None)

    async def get_run(self, *, run_id: str = "", child_id: str = "") -> RunRecord | None:
        self.require_open()
        if not run_id:
            found = await kvh.get(self.runs, f"c.{kvh.token(child_id)}")
            if found is None:
                return None
            run_id = found[0]
        loaded = await self._load_run(self._run_key(run_id))
        return loaded[0] if loaded else None

    async def list_runs(self, requester_id: str, include_archived: bool, after_key: str, limit: int):
        self.require_open()
        found = await kvh.get(self.runs, f"q.{kvh.token(requester_id)}")
        ids = found[0] if found else []
        if after_key:
            if after_key not in ids:
                raise errors.InvalidArgument(f"page_token {after_key!r} is not valid", reason=Reason.BAD_PAGE_TOKEN)
            ids = ids[ids.index(after_key) + 1:]
        runs = [r for r in await asyncio.gather(*(self.get_run(run_id=i) for i in ids)) if r is not None]
        return [r for r in runs if include_archived or not r.archived_at_us][:limit]

    async def _ended(self, run: RunRecord) -> None:
        await self._release_slot(run.requester_id, run.child_id)

    async def end_run(self, run_id, status, result, at_us, traceparent=""):
        self.require_open()
        already = []

        def change(run: RunRecord, rows: list[tuple]) -> bool:
            if run.status != runs_pb2.RUN_STATUS_RUNNING:
                already.append(True)
                return False
            if traceparent:
                run.traceparent = traceparent
            end(rows, run, status, result, at_us)
            return True

        run = await self._change_run(run_id, change)
        if not already:
            await self._ended(run)
        return run, bool(already)

    async def _end_runs_of_closed(self, closed: list[AgentRecord], at_us: int) -> None:
        for agent in closed:
            run = await self.get_run(child_id=agent.agent_id)
            if run is not None and run.status == runs_pb2.RUN_STATUS_RUNNING:
                await self.end_run(run.run_id, runs_pb2.RUN_STATUS_CLOSED, agent.close_reason, at_us)

    async def _mark_started(self, recipient: str, message_ids: list[str], at_us: int) -> None:
        if recipient in self._settled_starts:
            return
        run = await self.get_run(child_id=recipient)
        if run is None or run.started_at_us:  # runs are created with their child: no run now is no run ever
            self._remember_start(recipient)
            return
        if run.task_message_id not in message_ids:
            return
        self._remember_start(recipient)

        def change(run: RunRecord, rows: list[tuple]) -> bool:
            if run.started_at_us:
                return False
            run.started_at_us = at_us
            run_event(rows, run, ev.EVENT_KIND_RUN_STARTED, at_us)
            return True

        await self._change_run(run.run_id, change)

    def _remember_start(self, agent_id: str) -> None:
        if len(self._settled_starts) > 100_000:
            self._settled_starts.clear()
        self._settled_starts.add(agent_id)

    async def announce_run(self, run_id: str, at_us: int) -> AnnounceOutcome:
        self.require_open()
        run = await self.get_run(run_id=run_id)
        if run is None:
            raise errors.NotFound(f"no run {run_id}", reason=Reason.RUN_NOT_FOUND, metadata={"run_id": run_id})
        if run.announce_state != ANNOUNCE_PENDING:
            return AnnounceOutcome(run)
        stored = await self.inbox.store_announce(run, announce_envelope(run, at_us), at_us)
        outcome: dict = {}

        def change(current: RunRecord, rows: list[tuple]) -> bool:
            if current.announce_state != ANNOUNCE_PENDING:
                return False
            kind, detail, seq = stored
            if kind == "full":
                if current.announce_detail == detail:
                    return False
                current.announce_detail = detail
                run_event(rows, current, ev.EVENT_KIND_RUN_ANNOUNCE_DEFERRED, at_us, detail=detail)
                return True
            if kind == "stored":
                rows += announce_events(current, seq, at_us)
                settle(rows, current, ANNOUNCED, at_us, detail, seq)
                outcome["fresh"] = detail == "accepted"
            else:
                settle(rows, current, REQUESTER_GONE, at_us, detail)
            keep_if_kept(rows, current, at_us)
            return True

        run = await self._change_run(run_id, change)
        if stored[0] == "full":
            return AnnounceOutcome(run, retry=True)
        envelope = await self.inbox.envelope_at(run.requester_id, stored[2]) if outcome.get("fresh") else None
        return AnnounceOutcome(run, envelope)

    async def finish_cleanup(self, run_id: str, detail: str, at_us: int) -> RunRecord:
        self.require_open()

        def change(run: RunRecord, rows: list[tuple]) -> bool:
            if run.cleaned_up_at_us:
                return False
            run.cleaned_up_at_us = at_us
            run_event(rows, run, ev.EVENT_KIND_RUN_CLEANED_UP, at_us, detail=detail)
            return True

        return await self._change_run(run_id, change)

    async def archive_run(self, run_id: str, at_us: int) -> RunRecord:
        self.require_open()

        def change(run: RunRecord, rows: list[tuple]) -> bool:
            if run.archived_at_us:
                return False
            run.archived_at_us = at_us
            run_event(rows, run, ev.EVENT_KIND_RUN_ARCHIVED, at_us)
            return True

        run = await self._change_run(run_id, change)
        await self.kv["runwork"].delete(kvh.token(run_id))
        return run

    async def run_work(self, now_us: int, limit: int) -> RunWork:
        self.require_open()
        try:
            keys = await self.kv["runwork"].keys()
        except NoKeysError:
            keys = []
        runs = [r for r in await asyncio.gather(*(self.get_run(run_id=k) for k in keys))
                if r is not None and not r.archived_at_us]
        runs.sort(key=lambda r: r.created_at_us)
        settled = (ANNOUNCED, REQUESTER_GONE)
        return RunWork(
            overdue=[r.run_id for r in runs if r.status == runs_pb2.RUN_STATUS_RUNNING and r.deadline_us
                     and r.deadline_us <= now_us][:limit],
            pending=[r.run_id for r in runs if r.announce_state == ANNOUNCE_PENDING][:limit],
            cleanup=[r.run_id for r in runs if r.announce_state in settled and not r.cleaned_up_at_us][:limit],
            archivable=[r.run_id for r in runs if r.announce_state in settled and r.cleaned_up_at_us
                        and r.archive_at_us <= now_us][:limit],
        )


def _registered_row(record: AgentRecord) -> tuple:
    return base.event_row(record.created_at_us, ev.EVENT_KIND_AGENT_REGISTERED, record.agent_id,
                          sender=record.parent_id, detail=f"name={record.name} mode={record.mode} scope={record.scope_id}")


def _closed_row(agent_id: str, reason: str, at_us: int) -> tuple:
    return base.event_row(at_us, ev.EVENT_KIND_AGENT_CLOSED, agent_id, detail=reason)


def _unavailable_on_nats_errors(cls):
    """Every store call: a NATS failure (disconnected, timed out, no
    JetStream leader) is reported as Unavailable. Retrying is safe: sends
    carry their message ids, acks and state changes are compare-and-set."""
    for name in base.Store.__abstractmethods__:
        method = getattr(cls, name)
        if not asyncio.iscoroutinefunction(method):
            continue

        def wrap(method=method, name=name):
            @functools.wraps(method)
            async def call(self, *args, **kwargs):
                try:
                    return await method(self, *args, **kwargs)
                except errors.MeshError:
                    raise
                except (nats.errors.Error, TimeoutError, NatsApiError, OSError) as exc:
                    raise errors.Unavailable(
                        f"NATS JetStream did not answer ({type(exc).__name__}: {exc}); retry with the same"
                        " message ids (a send may have been stored; a retry is then a duplicate)",
                        reason=Reason.STORE_UNAVAILABLE) from None
            return call

        setattr(cls, name, wrap())
    return cls


def _matches(event: ev.Event, query: EventQuery) -> bool:
    if query.message_id and event.message_id != query.message_id:
        return False
    if query.sender and event.sender != query.sender:
        return False
    if query.agent_id and query.agent_id not in (event.agent_id, event.sender):
        return False
    return not query.kinds or event.kind in query.kinds


_unavailable_on_nats_errors(JetStreamStore)
