"""The event record on JetStream: stream IM_EVENTS, subject `im.ev.<agent>.<sender>`, the event id is
the stream sequence. Publishing, the listeners of this process, reading by filter; and the identity of
events that happen once (`dedup_id`), which lets the keeper publish an event again without recording
it twice."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

from nats.js.errors import APIError, NotFoundError

from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from services.store import base
from services.store.base import (
    ACCEPTED,
    CONSUMED,
    DEAD_LETTERED,
    DELIVERED,
    RECEIPT_NAME,
    CommitListener,
    EventQuery,
    EventRecord,
    EventRow,
)
from services.store.jetstream import kv
from services.store.jetstream.connection import IN_PROCESS, JetStreamConnection
from services.store.jetstream.kv import MessageState
from services.store.jetstream.shared_writes import SharedWrites

log = logging.getLogger(__name__)
_NOTICE_PREFIX = base.RESERVED_ID_PREFIX + "notice:"
_SENT, _STORED = ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED
_DELIVERED, _CONSUMED = ev.EVENT_KIND_MESSAGE_DELIVERED, ev.EVENT_KIND_MESSAGE_CONSUMED
_DEAD = ev.EVENT_KIND_MESSAGE_DEAD_LETTERED
ACCEPTED_NAME = RECEIPT_NAME[ACCEPTED]
"""The detail of the sent event of an accepted message (the receipt's name)."""
READ_BATCH = 512
"""Events one batched direct get reads (a list filters by kind and message id after reading)."""
_ONCE_PER_AGENT = (ev.EVENT_KIND_AGENT_REGISTERED, ev.EVENT_KIND_AGENT_CLOSED)
_ONCE_PER_RUN = (ev.EVENT_KIND_RUN_CREATED, ev.EVENT_KIND_RUN_STARTED, ev.EVENT_KIND_RUN_ENDED,
                 ev.EVENT_KIND_RUN_ANNOUNCED, ev.EVENT_KIND_RUN_REQUESTER_GONE, ev.EVENT_KIND_RUN_CLEANED_UP,
                 ev.EVENT_KIND_RUN_ARCHIVED)


def dedup_id(row: EventRow) -> str | None:
    """The identity of an event that happens once per message state, agent
    or run (None for events that have none): the same event published twice
    gets the same id."""
    if row.kind in _ONCE_PER_AGENT:
        return f"ev:{row.kind}:{row.agent_id}"
    if row.kind in _ONCE_PER_RUN:
        return f"ev:{row.kind}:{row.message_id}"  # run events carry the run id as message_id
    if row.seq <= 0 or not row.recipient:
        return None
    if row.kind in (_STORED, _CONSUMED, _DEAD) or (row.kind == _SENT and row.detail == ACCEPTED_NAME):
        return f"ev:{row.kind}:{row.recipient}:{row.seq}"  # one accepted send per stored message
    if row.kind == _DELIVERED:
        return f"ev:{row.kind}:{row.recipient}:{row.seq}:{row.detail}"
    return None


def stored_events(env: envelope_pb2.Envelope, recipient: str, seq: int) -> list[EventRow]:
    """The sent and stored events of a message accepted into `recipient`'s
    inbox at `seq`, as the process that stored it recorded them (a
    dead-letter notice has no sent event: the mesh sent it)."""
    mid, sender, trace_id = env.message_id, env.sender, trace_id_of(env.trace.traceparent)
    if mid.startswith(_NOTICE_PREFIX):
        return [EventRow(env.stored_at_us, _STORED, recipient, message_id=mid, sender=sender, recipient=recipient,
                         seq=seq, trace_id=trace_id, detail="dead-letter notice", in_reply_to=env.in_reply_to)]
    sent = EventRow(env.stored_at_us, _SENT, recipient, message_id=mid, sender=sender, recipient=recipient, seq=seq,
                    detail=ACCEPTED_NAME, trace_id=trace_id, in_reply_to=env.in_reply_to,
                    conversation_id=env.conversation_id)
    return [sent, EventRow(env.stored_at_us, _STORED, recipient, message_id=mid, sender=sender, recipient=recipient,
                           seq=seq, trace_id=trace_id, in_reply_to=env.in_reply_to,
                           conversation_id=env.conversation_id)]


def message_event(kind: int, at_us: int, recipient: str, env: envelope_pb2.Envelope, *, seq: int | None = None,
                  detail: str = "", turn: int = 0) -> EventRow:
    """An event about a message in `recipient`'s inbox (delivered, consumed) at `seq` (the envelope's)."""
    return EventRow(at_us, kind, recipient, message_id=env.message_id, sender=env.sender, recipient=recipient,
                    seq=env.sequence if seq is None else seq, detail=detail,
                    trace_id=trace_id_of(env.trace.traceparent), turn=turn, in_reply_to=env.in_reply_to,
                    conversation_id=env.conversation_id)


def dead_event(at_us: int, recipient: str, env: envelope_pb2.Envelope, reason: str) -> EventRow:
    return EventRow(at_us, _DEAD, recipient, message_id=env.message_id, sender=env.sender, recipient=recipient,
                    seq=env.sequence, detail=reason, trace_id=trace_id_of(env.trace.traceparent))


def implied_events(state: MessageState, seq: int) -> list[EventRow]:
    """The events a message state entry (of the message at `seq`) stands for:
    sent and stored, each delivery attempt, then consumed or dead-lettered,
    as the process that wrote it would have recorded them."""
    if state.state not in (DELIVERED, CONSUMED, DEAD_LETTERED) or state.envelope is None:
        return []
    env = state.envelope_pb()
    env.sequence = seq
    recipient = env.recipient
    env.stored_at_us = env.stored_at_us or state.stored_at_us
    rows = stored_events(env, recipient, seq)
    delivered_at = state.delivered_at_us or state.stored_at_us
    for attempt in range(1, state.attempts + 1):
        rows.append(message_event(ev.EVENT_KIND_MESSAGE_DELIVERED, delivered_at, recipient, env,
                                  detail=f"attempt={attempt}"))
    if state.state == CONSUMED:
        rows.append(message_event(ev.EVENT_KIND_MESSAGE_CONSUMED, state.consumed_at_us, recipient, env,
                                  turn=state.turn))
    elif state.state == DEAD_LETTERED:
        rows.append(dead_event(state.dead_at_us, recipient, env, state.dead_reason))
    return rows


class Recorded(NamedTuple):
    """What publishing one event came to."""

    seq: int
    """Its id (the stream sequence), or that of the recorded event it is a copy of."""
    duplicate: bool


TOLD_BYTES = 256 * 1024
"""A notice of recorded events carries at most about this many bytes of them (NATS refuses a message over
its max_payload, 1 MiB by default): more go as several notices."""
TOLD_PENDING_MSGS, TOLD_PENDING_BYTES = 10_000, 64 * 1024 * 1024
"""Notices of other processes waiting for this one at most: beyond, NATS drops them (a slow consumer, logged
once a minute at most), and the watchers read the record for the gap they leave."""


class EventLog:
    """Publishes event rows and reads them back; tells this process's commit listeners of the events it
    records, and the other processes of them (core NATS notices on `<ns>.evtold`, each a
    ListEventsResponse of the events with their ids), whose listeners it tells in turn."""

    def __init__(self, conn: JetStreamConnection):
        self.conn = conn
        self.listeners: list[CommitListener] = []
        self._pending: set[asyncio.Task[list[int]]] = set()

    @property
    def told_subject(self) -> str:
        return f"{self.conn.ns}.evtold"

    async def start(self) -> None:
        """Follow the events the other processes record (this connection does not get its own notices:
        `no_echo`)."""
        await self.conn.nc.subscribe(self.told_subject, cb=self._on_told, pending_msgs_limit=TOLD_PENDING_MSGS,
                                     pending_bytes_limit=TOLD_PENDING_BYTES)

    async def _on_told(self, msg: Any) -> None:
        try:
            events = ev.ListEventsResponse.FromString(msg.data).events
        except Exception:  # not a notice of this version: the listeners read the store for what they miss
            return
        for event in events:
            self._tell(event.event_id, EventRow.of(event))

    def _tell(self, event_id: int, row: EventRow) -> None:
        for callback in self.listeners:
            try:
                callback(event_id, [row])
            except Exception:  # a listener's bug must not fail the write that was made
                log.exception("event listener failed")

    async def _tell_others(self, events: list[EventRecord]) -> None:
        """Tell the other processes of events this one recorded, at most once each (core NATS: a notice
        lost, to a process reconnecting say, is an id its listeners do not get; they read the store)."""
        chunks: list[list[EventRecord]] = [[]]
        size = 0
        for event in events:
            if size >= TOLD_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(event)
            size += event.ByteSize()
        try:
            for chunk in filter(None, chunks):
                await self.conn.nc.publish(self.told_subject, ev.ListEventsResponse(events=chunk).SerializeToString())
        except Exception as exc:  # the connection gone: the events are stored; the notice is only a hint
            log.debug("events recorded but not told to the other processes: %r", exc)

    async def publish(self, rows: list[EventRow], *, copies: bool = False) -> list[Recorded]:
        """Publish event rows in order and tell this process's listeners of the new ones; for each, its id
        and whether it was a copy of a recorded one. A message event carries its identity (dedup_id) as
        Nats-Msg-Id, so a copy (the event keeper's, a delivery's of its message's sent and stored events)
        is dropped. Many rows go as atomic batches (JetStreamConnection.publish_batch), one message at a
        time when JetStream refuses a batch for a copy in it; `copies`: the rows may be copies, one at a
        time at once."""
        if not rows:
            return []
        events = [row.event(0) for row in rows]
        return await self._told(rows, events, await self._store(self._messages(rows, events), copies))

    def _messages(self, rows: list[EventRow], events: list[EventRecord]) -> list[tuple[str, bytes, dict[str, str]]]:
        """The NATS messages of the rows (`events`: their Event messages, ids not set yet)."""
        messages = []
        for row, event in zip(rows, events):
            ident = dedup_id(row)
            messages.append((f"{self.conn.ns}.ev.{kv.token(row.agent_id or '_')}.{kv.token(row.sender or '_')}",
                             event.SerializeToString(), {"Nats-Msg-Id": ident} if ident else {}))
        return messages

    async def _told(self, rows: list[EventRow], events: list[EventRecord], recorded: list[Recorded]
                    ) -> list[Recorded]:
        """Tell this process's listeners, then the other processes, of the rows recorded (not copies);
        `events`: their Event messages, given their ids here."""
        for done, row in zip(recorded, rows):
            if not done.duplicate:
                self._tell(done.seq, row)
        await self._tell_others(_with_ids(events, recorded))
        return recorded

    async def _store(self, messages: list[tuple[str, bytes, dict[str, str]]], copies: bool) -> list[Recorded]:
        # copies one at a time (one in an atomic batch would have it refused); the rest shared with the
        # events other calls publish at the same time (shared_writes.py)
        return self._recorded(await (self.conn.publish_each(messages) if copies else
                                     self.conn.event_writes.publish(messages)))

    @staticmethod
    def _recorded(acks: list[Any]) -> list[Recorded]:
        recorded = []
        for ack in acks:
            if isinstance(ack, APIError) and ack.err_code == IN_PROCESS:
                recorded.append(Recorded(0, True))  # another process is storing this very event: a copy
            elif isinstance(ack, BaseException):
                raise ack
            else:
                recorded.append(Recorded(ack.seq, bool(ack.duplicate)))
        return recorded

    async def emit(self, rows: list[EventRow]) -> list[int]:
        """Publish event rows, in order; ids (stream sequences) once stored."""
        return [ack.seq for ack in await self.publish(rows)]

    def emit_later(self, rows: list[EventRow]) -> None:
        """Publish in the background (owned: close() waits for it), queued now: ordered before every event
        this process publishes after the call (the shared writes are in order)."""
        if not rows:
            return
        events = [row.event(0) for row in rows]
        writes = self.conn.event_writes.enqueue(self._messages(rows, events))

        async def told() -> list[int]:
            recorded = await self._told(rows, events, self._recorded(await SharedWrites.answers(writes)))
            return [done.seq for done in recorded]

        task = asyncio.create_task(told())
        self._pending.add(task)
        task.add_done_callback(self._emitted)

    def _emitted(self, task: asyncio.Task[list[int]]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:  # the keeper restores what it can
            log.warning("events not recorded: %r", task.exception())

    async def drain(self) -> None:
        """Wait for what emit_later started (a failure there loses only those events)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def record(self, events: list[EventRecord], *, lazy: bool) -> list[int]:
        rows = [EventRow.of(e) for e in events]
        if lazy:
            self.emit_later(rows)
            return []
        return await self.emit(rows)

    async def last_event_id(self) -> int:
        return int((await self.conn.js.stream_info(self.conn.event_stream)).state.last_seq)

    async def read(self, query: EventQuery) -> list[EventRecord]:
        """The first `query.limit` matching events after `query.after_event_id`, in id order. An agent's
        events lie on two subjects (it is the subject, or the sender): each is read for its own first
        `limit` matches, and the union's first `limit` are the answer."""
        ns = self.conn.ns
        if query.agent_id:
            token = kv.token(query.agent_id)
            subjects = [f"{ns}.ev.{token}.*", f"{ns}.ev.*.{token}"]
        elif query.sender:
            subjects = [f"{ns}.ev.*.{kv.token(query.sender)}"]
        else:
            subjects = [f"{ns}.ev.>"]
        # A read answers up to one point of the stream, with nothing missing below it: a watcher passes
        # every id below what it read, for good. With replicas, any replica answers a direct get, and a
        # follower a moment behind its leader (busy, restarted, catching up) answers from what it has (two
        # mesh processes on three NATS nodes: one consumption in 2,300 never reached a watcher, in most
        # runs); and the two subjects of an agent are read one after the other, so the second may hold
        # events recorded after the first was read. So that point is the stream's last sequence when the
        # read begins, as the leader has it: everything up to it is read (from the leader where the
        # replica that answered had not got so far), nothing after it is answered.
        replicated = self.conn.config.nats_replicas > 1
        upto = await self.last_event_id() if replicated or len(subjects) > 1 else 0
        found: dict[int, EventRecord] = {}
        for subject in subjects:
            found.update(await self._read_subject(subject, query, upto if replicated else 0))
        return [found[k] for k in sorted(found) if not upto or k <= upto][:query.limit]

    async def _read_subject(self, subject: str, query: EventQuery, leader_last: int) -> dict[int, EventRecord]:
        """The subject's first `query.limit` matching events after the query's id, by id; every one up to
        `leader_last` among them (read from the leader where the replica that answered had not got so far)."""
        found: dict[int, EventRecord] = {}
        seq = query.after_event_id + 1
        """The first sequence not read yet."""
        while len(found) < query.limit:
            batch, more = await self.conn.direct_batch(self.conn.event_stream, subject, seq, READ_BATCH)
            for msg in batch:
                event = ev.Event.FromString(msg.data)
                event.event_id = int(msg.headers["Nats-Sequence"])
                seq = event.event_id + 1
                if _matches(event, query) and len(found) < query.limit:
                    found[event.event_id] = event
            if not batch or not more:
                break
        while len(found) < query.limit and seq <= leader_last:  # not reached by the replica that answered
            try:
                msg = await self.conn.js.get_msg(self.conn.event_stream, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            if msg.seq > leader_last:
                break
            event = ev.Event.FromString(msg.data)
            event.event_id = msg.seq
            if _matches(event, query):
                found[msg.seq] = event
            seq = msg.seq + 1
        return found


def _with_ids(events: list[EventRecord], recorded: list[Recorded]) -> list[EventRecord]:
    """The events recorded (not copies), each given its id."""
    told = []
    for event, done in zip(events, recorded):
        if not done.duplicate:
            event.event_id = done.seq
            told.append(event)
    return told


def _matches(event: EventRecord, query: EventQuery) -> bool:
    if query.message_id and event.message_id != query.message_id:
        return False
    if query.sender and event.sender != query.sender:
        return False
    if query.agent_id and query.agent_id not in (event.agent_id, event.sender):
        return False
    return not query.kinds or event.kind in query.kinds
