"""Inbox operations of the JetStream store: append with receipts, delivery
from the stream, exactly-once acks, dead letters.

A message's state entry (bucket im_msgs, key `m.<agent>.<seq>`, a
kv.MessageState) is the arbiter: it is created or changed only by
compare-and-set, so of an ack, a dead-lettering close and a send that finds
its target closed, exactly one wins. The message leaves the stream once its
state is final (consumed, dead or rejected), which keeps the per-subject
count equal to what is unconsumed. The stream itself (publish, read, take
back) is services.store.jetstream.messages.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from services.faults import crash_point
from services.store import base
from services.store.base import (
    ACCEPTED,
    CONSUMED,
    DEAD_LETTERED,
    DELIVERED,
    DUPLICATE,
    INBOX_FULL,
    NOT_PERMITTED,
    QUEUED,
    RECEIPT_NAME,
    TARGET_CLOSED,
    AckOutcome,
    AppendItem,
    DeliveryBatch,
    EventRow,
    Frontier,
    MessageRecord,
    RunRecord,
    SendOutcome,
)
from services.store.jetstream import kv
from services.store.jetstream.connection import ORIGIN_HEADER, JetStreamConnection
from services.store.jetstream.events import EventLog, dead_event, message_event, stored_events
from services.store.jetstream.kv import REJECTED, CasResult, MessageState
from services.store.jetstream.messages import InboxMessages

_MESH_ORIGIN = envelope_pb2.Origin(kind=envelope_pb2.ORIGIN_KIND_MESH)
_REMEMBERED = 50_000
"""First-delivery states kept per process for the acks that follow (oldest dropped first)."""


def frontier_key(agent_id: str) -> str:
    """The agent's loop-guard Frontier: [hop_count, trail] of what it consumed last."""
    return f"fr.{kv.token(agent_id)}"


class Announce(enum.Enum):
    STORED = "stored"
    FULL = "full"
    GONE = "gone"


@dataclass(frozen=True)
class AnnounceStored:
    """What storing a run's announce in its requester's inbox came to."""

    outcome: Announce
    detail: str
    """STORED: "accepted" or why it counts as stored; FULL, GONE: why not."""
    seq: int = 0


def _next_attempt(cur: MessageState | None, env: envelope_pb2.Envelope, now_us: int) -> MessageState | None:
    """The state after one more delivery (None: final, nothing to deliver)."""
    if cur is not None and cur.final:
        return None
    state = cur or MessageState.first(env, QUEUED)
    return replace(state, state=DELIVERED, attempts=state.attempts + 1,
                   delivered_at_us=state.delivered_at_us or now_us)


def _dead(cur: MessageState | None, env: envelope_pb2.Envelope, at_us: int, reason: str) -> MessageState | None:
    if cur is not None and cur.final:
        return None
    return (cur or MessageState.first(env, QUEUED)).dead(at_us, reason)


def _answers(sequences: list[int], by_seq: dict[int, tuple[AckOutcome, envelope_pb2.Envelope | None]]
             ) -> list[AckOutcome]:
    """One outcome per sequence as named: a repeat of a sequence consumed by its first mention is
    ALREADY_CONSUMED; any other repeat gets its first mention's outcome."""
    answered: set[int] = set()
    outcomes = []
    for seq in sequences:
        outcome, env = by_seq[seq]
        if seq in answered and env is not None:
            outcome = AckOutcome(seq, outcome.message_id, inbox_pb2.ACK_STATUS_ALREADY_CONSUMED)
        outcomes.append(outcome)
        answered.add(seq)
    return outcomes


_RUNS_AT_ONCE = 64
"""Recipients of one append whose messages are stored at the same time (InboxLog._append_all)."""


class InboxLog:
    def __init__(self, conn: JetStreamConnection, events: EventLog):
        self.conn = conn
        self.events = events
        self.messages = InboxMessages(conn)
        self.listeners: list[Callable[[str], None]] = []
        """Called with the recipient's subject token when another process appended to it."""
        self._delivered: dict[tuple[str, int], kv.Entry[MessageState]] = {}

    async def start(self) -> None:
        """Follow appends of every process (a core NATS subscription on the inbox subjects)."""
        await self.conn.nc.subscribe(f"{self.conn.ns}.inbox.*", cb=self._on_published)

    async def _on_published(self, msg: Any) -> None:
        if msg.headers and msg.headers.get(ORIGIN_HEADER) == self.conn.origin:
            return  # this process appended it and told the delivery hub already
        token = msg.subject.rsplit(".", 1)[-1]
        for callback in self.listeners:
            callback(token)

    def _remember(self, recipient: str, seq: int, entry: kv.Entry[MessageState]) -> None:
        """The state entry this process wrote at a first delivery, so the ack
        that usually follows can change it without reading it first."""
        self._delivered[(recipient, seq)] = entry
        if len(self._delivered) > _REMEMBERED:
            self._delivered.pop(next(iter(self._delivered)))

    # -- append ---------------------------------------------------------------------
    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        sender_open = True
        if not sender_id.startswith(base.EXTERNAL_PREFIXES):
            sender = await kv.read_agent(self.conn.agents, sender_id)
            sender_open = sender is not None and sender.is_open
        outcomes = await self._append_all(sender_id, sender_open, items, at_us)
        rows: list[EventRow] = []
        for item, outcome in zip(items, outcomes):
            env = item.envelope
            sent = EventRow(at_us, ev.EVENT_KIND_MESSAGE_SENT, outcome.recipient, message_id=env.message_id,
                            sender=sender_id, recipient=outcome.recipient, seq=outcome.sequence,
                            detail=RECEIPT_NAME[outcome.status], trace_id=trace_id_of(env.trace.traceparent),
                            in_reply_to=env.in_reply_to, conversation_id=env.conversation_id)
            rows.append(sent)
            if outcome.status == ACCEPTED:
                rows.append(replace(sent, kind=ev.EVENT_KIND_MESSAGE_STORED, agent_id=env.recipient, detail=""))
        await self.events.emit(rows)
        return outcomes

    async def _append_all(self, sender_id: str, sender_open: bool, items: list[AppendItem],
                          at_us: int) -> list[SendOutcome]:
        """The outcome of each item, in order. Each recipient's messages are stored one after the other
        (FIFO per pair), different recipients' at the same time (at most _RUNS_AT_ONCE): a batch waits
        for the requests of its longest run, not for those of every message one after the other (each
        is fsynced). One after the other throughout when the batch names a message id twice or counts a
        conversation budget: which copy is the duplicate, or which message the budget refuses, must not
        depend on timing."""
        runs: dict[str, list[int]] = {}
        for index, item in enumerate(items):
            runs.setdefault(item.envelope.recipient, []).append(index)
        ids = {item.envelope.message_id for item in items}
        if len(runs) == 1 or len(ids) < len(items) or any(
                item.conversation_budget and item.envelope.conversation_id for item in items):
            return [await self._append_one(sender_id, sender_open, item, at_us) for item in items]
        found: dict[int, SendOutcome] = {}
        room = asyncio.Semaphore(_RUNS_AT_ONCE)

        async def run(indexes: list[int]) -> None:
            async with room:
                for index in indexes:
                    found[index] = await self._append_one(sender_id, sender_open, items[index], at_us)

        tasks = [asyncio.ensure_future(run(indexes)) for indexes in runs.values()]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # a NATS failure: stop the other runs, raise it (the client retries by id)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [found[index] for index in range(len(items))]

    async def _append_one(self, sender_id: str, sender_open: bool, item: AppendItem, at_us: int) -> SendOutcome:
        env = item.envelope
        mid, rid = env.message_id, env.recipient
        idem = kv.idem_key(sender_id, mid)

        async def earlier() -> SendOutcome | None:
            """The receipt of an earlier attempt of this message, if it was stored."""
            original = await kv.get(self.conn.msgs, idem, kv.STORED)
            if original is None:
                return None
            stored = original.value
            return SendOutcome(mid, stored.recipient, DUPLICATE, stored.seq, stored.stored_at_us,
                               "already accepted from this sender; nothing stored again")

        budgeted = bool(item.conversation_budget and env.conversation_id)
        if budgeted and (duplicate := await earlier()):
            return duplicate  # before the budget is counted: a retry does not use it up
        refusal, capacity = await self._refusal(sender_id, sender_open, item, budgeted)
        if refusal is not None:
            # a refused send may be the retry of one stored before things changed: that stays a duplicate
            return (None if budgeted else await earlier()) or refusal
        env.sender = sender_id
        env.sequence = 0
        env.stored_at_us = at_us
        env.delivery_attempt = 0
        status, detail, seq = await self.messages.publish(rid, env, capacity)
        if status not in (ACCEPTED, DUPLICATE):
            return SendOutcome(mid, rid, status, detail=detail)
        if not await kv.create(self.conn.msgs, idem, kv.Stored(rid, seq, at_us), kv.STORED) and status == ACCEPTED:
            # stored before, longer ago than JetStream's duplicate window: take this copy back
            duplicate = await earlier()
            if duplicate is not None and duplicate.sequence != seq and await self.messages.reject(rid, seq):
                return duplicate
        if status == DUPLICATE:
            return SendOutcome(mid, rid, DUPLICATE, seq, at_us, detail)
        env.sequence = seq
        return SendOutcome(mid, rid, ACCEPTED, seq, at_us, envelope=env)

    async def _refusal(self, sender_id: str, sender_open: bool, item: AppendItem,
                       budgeted: bool) -> tuple[SendOutcome | None, int]:
        """Why this send is refused before it is stored (or None), and the
        target's inbox capacity."""
        env = item.envelope
        mid, rid = env.message_id, env.recipient
        if item.rejection is not None:
            return SendOutcome(mid, rid, item.rejection[0], detail=item.rejection[1]), 0
        if not sender_open:
            return SendOutcome(mid, rid, NOT_PERMITTED, detail=f"sender {sender_id} is closed"), 0
        target = await kv.read_agent(self.conn.agents, rid)
        if target is None:
            return SendOutcome(mid, rid, base.UNKNOWN_TARGET, detail=f"no agent {rid}"), 0
        if not target.is_open:
            return SendOutcome(mid, rid, TARGET_CLOSED, detail=f"agent {rid} is closed"), 0
        if budgeted and not await self._within_budget(env.conversation_id, item.conversation_budget):
            return SendOutcome(mid, rid, NOT_PERMITTED,
                               detail=f"loop guard: conversation {env.conversation_id} has used its budget of"
                                      f" {item.conversation_budget} messages"), 0
        return None, target.inbox_capacity

    async def _within_budget(self, conversation_id: str, budget: int) -> bool:
        counted = await kv.cas(self.conn.misc, f"conv.{kv.token(conversation_id)}",
                               lambda cur: None if (cur or 0) >= budget else (cur or 0) + 1, kv.JSON)
        return counted is not None

    # -- delivery -------------------------------------------------------------------
    async def next_deliveries(self, recipient: str, after_sequence: int, limit: int, max_attempts: int,
                              now_us: int, in_flight: int = 0) -> DeliveryBatch:
        agent = await kv.read_agent(self.conn.agents, recipient)
        if agent is None or not agent.is_open:
            return DeliveryBatch([], [], recipient_open=False,
                                 close_reason=agent.close_reason if agent else "unknown agent")
        if agent.inbox_capacity < self.conn.config.max_inbox_capacity:
            # A sender settles capacity after publishing (messages.publish): a message beyond the first
            # `capacity` unconsumed ones may still be taken back, so it is not delivered (that would make the
            # take-back fail and the inbox hold more than its capacity). It is delivered once acks make room.
            room = agent.inbox_capacity - in_flight
            if room <= 0:
                return DeliveryBatch([], [], recipient_open=True, held_back=True)
            held_back, limit = room < limit, min(limit, room)
        else:
            held_back = False
        msgs = self.conn.msgs
        envelopes: list[envelope_pb2.Envelope] = []
        dead: list[MessageRecord] = []
        notices: list[envelope_pb2.Envelope] = []
        rows: list[EventRow] = []
        seq = after_sequence + 1
        while len(envelopes) + len(dead) < limit:
            env = await self.messages.next(recipient, seq)
            if env is None:
                break
            seq = env.sequence + 1
            key = kv.state_key(recipient, env.sequence)
            expired = bool(env.expires_at_us and env.expires_at_us <= now_us)
            deliver = functools.partial(_next_attempt, env=env, now_us=now_us)

            written = None
            if not expired and max_attempts > 0:  # the usual case, a first delivery: one request
                first = deliver(None)
                assert first is not None
                revision = await kv.create(msgs, key, first, kv.MESSAGE_STATE)
                if revision:
                    written = first
                    self._remember(recipient, env.sequence, kv.Entry(first, revision))
            if written is None:
                found = await kv.get(msgs, key, kv.MESSAGE_STATE)
                state = found.value if found else None
                if state is not None and state.final:
                    await self.messages.delete(env.sequence)
                    continue
                attempts = state.attempts if state else 0
                reason = base.REASON_EXPIRED if expired else (
                    base.REASON_ATTEMPTS if attempts >= max_attempts else "")
                if reason:
                    record, notice = await self.dead_letter(recipient, env, reason, now_us)
                    if record is not None:
                        dead.append(record)
                    if notice is not None:
                        notices.append(notice)
                    continue
                written = await kv.cas(msgs, key, deliver, kv.MESSAGE_STATE)
                if written is None:
                    continue
            env.delivery_attempt = written.attempts
            if env.delivery_attempt == 1:
                # the sent and stored events first (copies of the sender's, dropped as such): the record
                # stays in causal order even when this feed is faster than the sender's replica
                rows += stored_events(env, recipient, env.sequence)
            rows.append(message_event(ev.EVENT_KIND_MESSAGE_DELIVERED, now_us, recipient, env,
                                      detail=f"attempt={env.delivery_attempt}"))
            envelopes.append(env)
        await self.events.emit(rows)  # before the subscriber can ack: consumed always follows delivered
        return DeliveryBatch(envelopes, dead, recipient_open=True, notices=notices,
                             held_back=held_back and len(envelopes) + len(dead) >= limit)

    # -- acks -----------------------------------------------------------------------
    async def ack_many(self, entries: list[tuple[str, list[int], int]], at_us: int) -> list[list[AckOutcome]]:
        """Every entry's acks in two rounds of requests, whatever the number of entries: first the state
        changes (compare-and-set) of every distinct sequence of every entry at once; then, together, the
        deletes of what they consumed, all their CONSUMED events (one pipelined publish) and each
        recipient's new frontier. A sequence an entry names twice is answered for its first mention
        and ALREADY_CONSUMED (or the same refusal) after, as one ack after the other would."""
        distinct = [list(dict.fromkeys(sequences)) for _, sequences, _ in entries]
        taken = await asyncio.gather(*(self._consume(recipient, seq, at_us, turn)
                                       for (recipient, _, turn), seqs in zip(entries, distinct) for seq in seqs),
                                     return_exceptions=True)
        failure = next((t for t in taken if isinstance(t, BaseException)), None)
        results = iter(taken)
        answers: list[list[AckOutcome]] = []
        rows: list[EventRow] = []
        deletes: list[int] = []
        frontiers: dict[str, Frontier] = {}
        for (recipient, sequences, turn), seqs in zip(entries, distinct):
            by_seq: dict[int, tuple[AckOutcome, envelope_pb2.Envelope | None]] = {}
            consumed = []
            for seq in seqs:
                result = next(results)
                if isinstance(result, BaseException):
                    continue
                by_seq[seq] = result
                if (env := result[1]) is not None:
                    consumed.append(env)
                    deletes.append(seq)
                    rows.append(message_event(ev.EVENT_KIND_MESSAGE_CONSUMED, at_us, recipient, env, seq=seq,
                                              turn=turn))
            if failure is None:
                answers.append(_answers(sequences, by_seq))
            frontier = Frontier.of(consumed)
            if frontier is not None:
                frontiers[recipient] = frontier  # a recipient named again: its later entry's, as in turn
        if rows:
            crash_point("consumed-unrecorded")  # the consumptions are stored, their events not yet
        # The frontiers only guard the agents' next sends, and a final message left on the stream (a
        # crash before its delete) is deleted by the next read of its inbox: all of them go together.
        await asyncio.gather(self.events.emit(rows), *(self.messages.delete(seq) for seq in deletes),
                             *(self.conn.msgs.put(frontier_key(recipient),
                                                  json.dumps([f.hop_count, f.trail]).encode())
                               for recipient, f in frontiers.items()))
        if failure is not None:  # what the others consumed is recorded; this one is retried by the client
            raise failure
        return answers

    async def frontier(self, agent_id: str) -> Frontier | None:
        found = await kv.get(self.conn.msgs, frontier_key(agent_id), kv.JSON)
        return None if found is None else Frontier(found.value[0], tuple(found.value[1]))

    async def _consume(self, recipient: str, seq: int, at_us: int,
                       turn: int) -> tuple[AckOutcome, envelope_pb2.Envelope | None]:
        """The outcome of acking one message (its state entry set to consumed by compare-and-set), and
        the envelope when this ack consumed it; ack_many deletes it from the stream."""
        msgs = self.conn.msgs
        key = kv.state_key(recipient, seq)
        remembered = self._delivered.pop((recipient, seq), None)
        for _ in range(kv.MAX_CAS_TRIES):
            found, remembered = remembered or await kv.get(msgs, key, kv.MESSAGE_STATE), None
            if found is not None:
                state = found.value
                if state.state == CONSUMED:
                    return AckOutcome(seq, state.message_id, inbox_pb2.ACK_STATUS_ALREADY_CONSUMED), None
                if state.state == DEAD_LETTERED:
                    return AckOutcome(seq, state.message_id, inbox_pb2.ACK_STATUS_DEAD_LETTERED), None
                if state.state == REJECTED:
                    return AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND), None
                new = state.consumed(at_us, turn)
                if await kv.write(msgs, key, new.encode(), found.revision) is CasResult.LOST:
                    continue
                env = new.envelope_pb()
            else:
                fresh = await self.messages.envelope_at(recipient, seq)
                if fresh is None:
                    return AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND), None
                env = fresh
                if not await kv.create(msgs, key, MessageState.first(env, QUEUED).consumed(at_us, turn),
                                       kv.MESSAGE_STATE):
                    continue
            return AckOutcome(seq, env.message_id, inbox_pb2.ACK_STATUS_CONSUMED, env.trace.traceparent, env), env
        raise errors.Unavailable(f"too much contention acking {seq} in {recipient}'s inbox", reason=Reason.CONTENTION)

    # -- dead letters ---------------------------------------------------------------
    async def dead_letter(self, recipient: str, env: envelope_pb2.Envelope, reason: str,
                          at_us: int) -> tuple[MessageRecord | None, envelope_pb2.Envelope | None]:
        """Dead-letter one message unless its state is already final; tell
        its sender. Returns (record, notice)."""
        msgs = self.conn.msgs
        die = functools.partial(_dead, env=env, at_us=at_us, reason=reason)
        written = await kv.cas(msgs, kv.state_key(recipient, env.sequence), die, kv.MESSAGE_STATE)
        if written is None:
            return None, None
        await self.messages.delete(env.sequence)
        await kv.cas(msgs, f"dr.{kv.token(recipient)}", lambda cur: [*(cur or []), env.sequence], kv.JSON)
        await kv.cas(msgs, f"ds.{kv.token(env.sender)}", lambda cur: [*(cur or []), [recipient, env.sequence]],
                     kv.JSON)
        await self.events.emit([dead_event(at_us, recipient, env, reason)])
        notice = None
        if env.origin.kind != envelope_pb2.ORIGIN_KIND_MESH and env.sender != recipient \
                and not env.sender.startswith(base.EXTERNAL_PREFIXES):
            notice = await self._notice(env, recipient, reason, at_us)
        return written.record(), notice

    async def _notice(self, dead: envelope_pb2.Envelope, recipient: str, reason: str,
                      at_us: int) -> envelope_pb2.Envelope | None:
        sender = await kv.read_agent(self.conn.agents, dead.sender)
        if sender is None or not sender.is_open:
            return None
        message_id = f"{base.RESERVED_ID_PREFIX}notice:{recipient}:{dead.sequence}"
        notice = envelope_pb2.Envelope(
            message_id=message_id, sender=recipient, recipient=dead.sender, kind=envelope_pb2.MESSAGE_KIND_CONTROL,
            content=envelope_pb2.Content(text=f"Your message {dead.message_id} to {recipient} was not consumed:"
                                              f" {reason}."),
            in_reply_to=dead.message_id, conversation_id=dead.conversation_id, trace=dead.trace, origin=_MESH_ORIGIN,
            headers={"inboxmesh-notice": "dead-lettered", "inboxmesh-reason": reason}, created_at_us=at_us,
            stored_at_us=at_us)
        status, detail, seq = await self.messages.publish(dead.sender, notice, sender.inbox_capacity)
        if status != ACCEPTED:
            await self.events.emit([EventRow(at_us, ev.EVENT_KIND_NOTICE_UNDELIVERED, dead.sender,
                                             message_id=message_id, sender=recipient, recipient=dead.sender,
                                             detail=f"{'inbox full' if status == INBOX_FULL else detail};"
                                                    f" {dead.message_id} was dead-lettered: {reason}")])
            return None
        await kv.create(self.conn.msgs, kv.idem_key(recipient, message_id), kv.Stored(dead.sender, seq, at_us),
                        kv.STORED)
        notice.sequence = seq
        await self.events.emit([EventRow(at_us, ev.EVENT_KIND_MESSAGE_STORED, dead.sender, message_id=message_id,
                                         sender=recipient, recipient=dead.sender, seq=seq,
                                         detail="dead-letter notice", trace_id=trace_id_of(dead.trace.traceparent),
                                         in_reply_to=dead.message_id)])
        return notice

    async def dead_letter_all(self, recipient: str, reason: str,
                              at_us: int) -> tuple[list[MessageRecord], list[envelope_pb2.Envelope]]:
        dead: list[MessageRecord] = []
        notices: list[envelope_pb2.Envelope] = []
        seq = 1
        while True:
            env = await self.messages.next(recipient, seq)
            if env is None:
                return dead, notices
            seq = env.sequence + 1
            record, notice = await self.dead_letter(recipient, env, reason, at_us)
            if record is not None:
                dead.append(record)
            if notice is not None:
                notices.append(notice)

    # -- announce ---------------------------------------------------------------------
    async def store_announce(self, run: RunRecord, env: envelope_pb2.Envelope, at_us: int) -> AnnounceStored:
        """Store a run's announce in its requester's inbox, at most once."""
        idem = kv.idem_key(run.child_id, env.message_id)
        found = await kv.get(self.conn.msgs, idem, kv.STORED)
        if found is not None:
            return AnnounceStored(Announce.STORED, "duplicate: stored by an earlier attempt", found.value.seq)
        requester = await kv.read_agent(self.conn.agents, run.requester_id)
        if requester is None:
            return AnnounceStored(Announce.GONE, f"requester {run.requester_id} does not exist")
        if not requester.is_open:
            return AnnounceStored(Announce.GONE, f"requester {run.requester_id} is closed ({requester.close_reason})")
        env.stored_at_us = at_us
        status, _, seq = await self.messages.publish(run.requester_id, env, requester.inbox_capacity)
        if status == INBOX_FULL:
            held = await self.messages.unconsumed(run.requester_id)
            return AnnounceStored(Announce.FULL, f"requester {run.requester_id}'s inbox is full ({held} of"
                                                 f" {requester.inbox_capacity}); retrying")
        if status == TARGET_CLOSED:
            return AnnounceStored(Announce.GONE, f"requester {run.requester_id} is closed")
        await kv.create(self.conn.msgs, idem, kv.Stored(run.requester_id, seq, at_us), kv.STORED)
        return AnnounceStored(Announce.STORED,
                              "accepted" if status == ACCEPTED else "duplicate: stored by an earlier attempt", seq)

    # -- queries ----------------------------------------------------------------------
    async def by_inbox(self, recipient: str, seq: int) -> MessageRecord | None:
        found = await kv.get(self.conn.msgs, kv.state_key(recipient, seq), kv.MESSAGE_STATE)
        if found is not None:
            return None if found.value.state == REJECTED else found.value.record()
        env = await self.messages.envelope_at(recipient, seq)
        if env is None:
            return None
        return MessageRecord(envelope=env, state=QUEUED, attempts=0, stored_at_us=env.stored_at_us)

    async def by_sender(self, sender: str, message_id: str) -> MessageRecord | None:
        found = await kv.get(self.conn.msgs, kv.idem_key(sender, message_id), kv.STORED)
        if found is None:
            return None
        return await self.by_inbox(found.value.recipient, found.value.seq)

    async def dead_letters(self, *, recipient: str, sender: str, after_key: str,
                           limit: int) -> tuple[list[MessageRecord], str]:
        try:
            start = int(after_key or 0)
        except ValueError:
            raise errors.InvalidArgument(f"page_token {after_key!r} is not valid",
                                         reason=Reason.BAD_PAGE_TOKEN) from None
        keys: list[tuple[str, int]]
        if sender:
            found = await kv.get(self.conn.msgs, f"ds.{kv.token(sender)}", kv.JSON)
            keys = [(r, s) for r, s in (found.value if found else [])]
        else:
            found = await kv.get(self.conn.msgs, f"dr.{kv.token(recipient)}", kv.JSON)
            keys = [(recipient, s) for s in (found.value if found else [])]
        page = keys[start:start + limit]
        records = await asyncio.gather(*(self.by_inbox(r, s) for r, s in page))
        return [r for r in records if r is not None], (str(start + limit) if len(page) == limit else "")
