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
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from services.config import OUTBOX_LIMIT
from services.faults import crash_point
from services.store import base
from services.store import notices as notices_of
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
    AgentRecord,
    AppendItem,
    DeliveryBatch,
    EventRow,
    Frontier,
    MessageRecord,
    RunRecord,
    SendOutcome,
)
from services.store.jetstream import kv
from services.store.jetstream.agent_cache import AgentCache
from services.store.jetstream.connection import NATS_FAILURES, REPLAY_HORIZON_US, JetStreamConnection
from services.store.jetstream.events import EventLog, dead_event, implied_events, message_event, stored_events
from services.store.jetstream.kv import REJECTED, CasResult, MessageState
from services.store.jetstream.messages import InboxMessages
from services.store.jetstream.outbox import Outbox
from services.store.jetstream.shared_reads import BatchedReads

log = logging.getLogger(__name__)
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


def _dead(cur: MessageState | None, env: envelope_pb2.Envelope, at_us: int, reason: str,
          delivered: MessageState | None = None) -> MessageState | None:
    """Dead-lettered, unless final already; `delivered`: its first delivery, not written yet."""
    if cur is not None and cur.final:
        return None
    return (cur or delivered or MessageState.first(env, QUEUED)).dead(at_us, reason)


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


MARK_DELAY_S = 0.05
"""How long the state entry of a first delivery waits to be written. An ack that comes first writes the
consumed state instead: one write for both, as the SQLite store's delivered markers ride with its next
commit. A mesh process that dies meanwhile loses the count of that one attempt (the message is delivered
again as a first attempt); its delivered event is recorded either way."""
_UNMARKED_MAX = 10_000
"""First deliveries waiting to be written at most; beyond, they are written at once (with their delivered
events, InboxLog._deferred)."""

_TELL_AGAIN_S = 0.1
"""A notice of another process's append wakes the agent's feed at once and again this much later."""

_RUNS_AT_ONCE = 64
"""Recipients of one append whose messages are stored at the same time (InboxLog._append_all)."""


async def _shared_wait(futures: Iterable[asyncio.Future[None]]) -> None:
    """Wait for writes other calls wait for too (a first delivery's state entry, an append's events),
    shielded: a waiter cancelled here (its subscription broke, its ack's deadline passed) must not cancel
    the shared future. A cancelled one made every later wait for it raise CancelledError: the next
    subscription's delivery of those messages ended as if its stream had been cancelled, and nothing more
    was delivered (CI, twice: 151 of 200 messages queued for 240 s after a NATS restart, first through a
    delivery's wait, then through an ack's)."""
    await asyncio.gather(*(asyncio.shield(future) for future in futures))


def _remember_keys(table: dict[tuple[str, int], None], keys: Iterable[tuple[str, int]]) -> None:
    """Add the keys to a table of remembered messages, the oldest dropped beyond _REMEMBERED."""
    for key in keys:
        table[key] = None
    _trim(table)


def _trim(table: dict[tuple[str, int], Any]) -> None:
    """Drop a table's oldest entries beyond _REMEMBERED."""
    while len(table) > _REMEMBERED:
        table.pop(next(iter(table)))


def _delivered_copy(before: MessageState, recipient: str, env: envelope_pb2.Envelope,
                    seq: int, now_us: int) -> EventRow | None:
    """A copy of the first delivery's event of a message consumed through this process and not delivered by
    it (`before`: its written state before the ack), to be recorded before its consumed event: the process
    that delivered it records that event once the delivery's state entry is written (InboxLog._mark), and
    may not have yet; the copy keeps the record's causal order (theirs is dropped as a copy). Copied while
    the duplicate window would drop the copy of one recorded. A later attempt's event was recorded before
    it went out (next_deliveries): not copied. No state entry (a first delivery not written yet, or none):
    no copy, and the delivering process, whose write of the state then loses to this consumption, records
    no delivered event after it."""
    if before.attempts != 1 or before.delivered_at_us < now_us - REPLAY_HORIZON_US:
        return None
    return message_event(ev.EVENT_KIND_MESSAGE_DELIVERED, before.delivered_at_us, recipient, env, seq=seq,
                         detail="attempt=1")


class InboxLog:
    def __init__(self, conn: JetStreamConnection, events: EventLog, agents: AgentCache):
        self.conn = conn
        self.events = events
        self.agents = agents
        """Agent records as last seen: read before a send and a delivery (agent_cache.py says why that is safe)."""
        self.messages = InboxMessages(conn, agents.fresh)
        self._outbox = Outbox(conn)
        """The IOA outbox: dead-letter notices to IOA senders go in (services.store.notices)."""
        self._frontiers: BatchedReads[Frontier | None] = BatchedReads(self._read_frontiers, None)
        self._has_state: BatchedReads[bool] = BatchedReads(self._read_has_state, False)
        """Whether a message's state entry exists (by state key), read for the deliveries of many inboxes
        at the same moment together (a subscription reads its round's feeds at once)."""
        self.listeners: list[Callable[[str], None]] = []
        """Called with the recipient's subject token when another process appended to it."""
        self._delivered: dict[tuple[str, int], kv.Entry[MessageState]] = {}
        self._unmarked: dict[tuple[str, int], MessageState] = {}
        """First deliveries whose state entry is not written yet (MARK_DELAY_S), by (recipient, sequence)."""
        self._marking: dict[tuple[str, int], asyncio.Future[None]] = {}
        """Those being written now: done when the write is."""
        self._mark_timer: asyncio.TimerHandle | None = None
        self._mark_tasks: set[asyncio.Task[None]] = set()
        self._recording: dict[tuple[str, int], asyncio.Future[None]] = {}
        """Messages this process published whose sent and stored events it is about to record: done when
        the append that stores them is (a first delivery meanwhile waits for it, and publishes no copies)."""
        self._recorded: dict[tuple[str, int], None] = {}
        """Messages whose sent and stored events this process published (oldest dropped first): their first
        delivery here need not publish copies of them."""
        self._unrecorded: dict[tuple[str, int], list[EventRow]] = {}
        """Deliveries handed out whose events NATS did not take (a stream without a leader a moment): by
        (recipient, sequence), the events to publish, as copies, before the message's consumption or next
        delivery (oldest dropped first beyond _REMEMBERED: the keeper records them from the state entries)."""
        self._deferred: dict[tuple[str, int], list[EventRow]] = {}
        """The delivered events of first deliveries not written yet (_unmarked), by (recipient, sequence):
        they ride with the message's consumed event when the ack comes through this process first
        (ack_many), or with its dead-lettering, or are recorded once its state entry is written (_mark;
        dropped when that write loses to a consumption elsewhere, which recorded no delivery), as the SQLite
        store's ride with its next commit. Before (until 2026-12-07) a delivery waited for its delivered
        events' write before handing the messages out: one write more a message, on the chain."""
        self._recorded_elsewhere: dict[tuple[str, int], None] = {}
        """Messages whose sent and stored events another process recorded before it told us of them, by
        (recipient's subject token, sequence) (oldest dropped first): no copies of them either."""

    async def start(self) -> None:
        """Follow the appends of the other processes (the core NATS notices messages.InboxMessages.told
        sends; this connection does not get its own, `no_echo`: its appends woke its delivery hub already)."""
        await self.conn.nc.subscribe(self.conn.appended_subject("*"), cb=self._on_published)

    async def _on_published(self, msg: Any) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        try:
            recorded = [int(seq) for seq in msg.data.decode().split(",") if seq]
        except ValueError:
            recorded = []  # not a notice of this version: copies are published, as for no list
        _remember_keys(self._recorded_elsewhere, ((token, seq) for seq in recorded))
        self._tell(token)
        if self.conn.config.nats_replicas > 1:
            # once more a moment later: a follower a moment behind its leader may answer the read (with one
            # replica a read sees what was told; a read again would find the next message of the inbox, not
            # told yet, and publish copies of its events)
            asyncio.get_running_loop().call_later(_TELL_AGAIN_S, self._tell, token)

    def _tell(self, token: str) -> None:
        for callback in self.listeners:
            callback(token)

    def _note_recorded(self, outcomes: list[SendOutcome]) -> None:
        _remember_keys(self._recorded, ((o.recipient, o.sequence) for o in outcomes if o.status == ACCEPTED))

    def _copies_needed(self, recipient: str, env: envelope_pb2.Envelope, now_us: int) -> bool:
        """Whether a first delivery publishes copies of the message's sent and stored events: not when
        this process published them, nor when the message is so old that a copy would not be dropped."""
        if self._recorded.pop((recipient, env.sequence), 0) is None:
            return False
        if self._recorded_elsewhere.pop((kv.token(recipient), env.sequence), 0) is None:
            return False
        return env.stored_at_us >= now_us - REPLAY_HORIZON_US

    def _remember(self, recipient: str, seq: int, entry: kv.Entry[MessageState]) -> None:
        """The state entry this process wrote at a first delivery, so the ack
        that usually follows can change it without reading it first."""
        self._delivered[(recipient, seq)] = entry
        if len(self._delivered) > _REMEMBERED:
            self._delivered.pop(next(iter(self._delivered)))

    # -- append ---------------------------------------------------------------------
    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        return (await self.append_many([(sender_id, items)], at_us))[0]

    async def append_many(self, groups: list[tuple[str, list[AppendItem]]], at_us: int) -> list[list[SendOutcome]]:
        """The groups (sender id, its messages) stored as one append, the outcomes of each group in turn:
        each recipient's messages, whatever their senders, published in the order given (so per sender
        and per inbox sequences follow it), different recipients' at the same time. When the groups name
        a (sender, message id) twice or count a conversation budget (`entries_in_turn`), every message
        is stored one after the other instead (_append_all); JetStreamStore.append_groups sends such a
        read group by group through services.store.ordering, so groups sharing nothing still run at once."""
        entries = [(sender_id, item) for sender_id, items in groups for item in items]
        senders = list(dict.fromkeys(sender_id for sender_id, _ in entries
                                     if not sender_id.startswith(base.EXTERNAL_PREFIXES)))
        recipients = list(dict.fromkeys(item.envelope.recipient for _, item in entries))
        # each sender as the bucket holds it now (a close another process made a moment ago refuses this
        # send, and nothing of it is ever delivered): read since the mesh took the request (the read made
        # beside the sender's frontier, JetStreamStore.get_frontier); every target as last seen, read
        # when not held (a target closed since is settled after the publish: messages.settle)
        taken: dict[str, float] = {}
        for sender_id, item in entries:
            taken[sender_id] = min(taken.get(sender_id, math.inf), item.taken_at)
        found = await asyncio.gather(*(self.agents.fresh(sender_id, taken[sender_id]) for sender_id in senders),
                                     *(self.agents.get(rid) for rid in recipients))
        sender_open = {sender_id: record is not None and record.is_open
                       for sender_id, record in zip(senders, found)}
        targets = dict(zip(recipients, found[len(senders):]))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        published: list[tuple[str, int]] = []
        recorded: list[SendOutcome] = []
        try:
            outcomes = await self._append_all(entries, sender_open, targets, at_us,
                                              functools.partial(self._publishing, done, published))
            await self._record_sent(entries, outcomes, at_us)
            recorded = outcomes
        finally:
            for key in published:
                self._recording.pop(key, None)
            if not done.done():
                done.set_result(None)
            if published:
                await self._tell_appended(published, recorded)
        answers = iter(outcomes)
        return [[next(answers) for _ in items] for _, items in groups]

    @staticmethod
    def entries_in_turn(groups: list[tuple[str, list[AppendItem]]]) -> bool:
        """Whether these groups name a (sender, message id) twice or count a conversation budget: then
        their messages must be stored one after the other (append_many cannot take them together)."""
        keys = [(sender_id, item.envelope.message_id) for sender_id, items in groups for item in items]
        return len(set(keys)) < len(keys) or any(item.conversation_budget and item.envelope.conversation_id
                                                 for _, items in groups for item in items)

    async def _tell_appended(self, published: list[tuple[str, int]], recorded: list[SendOutcome]) -> None:
        """Tell the other processes of the messages an append put on the stream, once it recorded their sent
        and stored events (`recorded`: the outcomes whose events are; none when recording failed), naming
        the sequences accepted so: a first delivery there publishes no copies of their events. Told only
        now, a delivery elsewhere seldom comes before the events (it would publish copies of them first)."""
        accepted: dict[str, list[int]] = {}
        for outcome in recorded:
            if outcome.status == ACCEPTED:
                accepted.setdefault(outcome.recipient, []).append(outcome.sequence)
        recipients = dict.fromkeys(recipient for recipient, _ in published)
        try:
            await asyncio.gather(*(self.messages.told(recipient, accepted.get(recipient, ()))
                                   for recipient in recipients))
        except Exception as exc:  # NATS gone: the append's own outcome (or failure) is what the caller gets
            log.debug("appends not told to the other processes: %r", exc)

    def _publishing(self, done: asyncio.Future[None], published: list[tuple[str, int]], recipient: str,
                    seq: int) -> None:
        """A message of an append in progress is on the stream: a delivery of it waits for the append."""
        self._recording[(recipient, seq)] = done
        published.append((recipient, seq))

    async def _record_sent(self, entries: list[tuple[str, AppendItem]], outcomes: list[SendOutcome],
                           at_us: int) -> None:
        rows: list[EventRow] = []
        for (sender_id, item), outcome in zip(entries, outcomes):
            env = item.envelope
            sent = EventRow(at_us, ev.EVENT_KIND_MESSAGE_SENT, outcome.recipient, message_id=env.message_id,
                            sender=sender_id, recipient=outcome.recipient, seq=outcome.sequence,
                            detail=RECEIPT_NAME[outcome.status], trace_id=trace_id_of(env.trace.traceparent),
                            in_reply_to=env.in_reply_to, conversation_id=env.conversation_id)
            rows.append(sent)
            if outcome.status == ACCEPTED:
                rows.append(replace(sent, kind=ev.EVENT_KIND_MESSAGE_STORED, agent_id=env.recipient, detail=""))
        await self.events.emit(rows)
        self._note_recorded(outcomes)

    async def _append_all(self, entries: list[tuple[str, AppendItem]], sender_open: dict[str, bool],
                          targets: dict[str, AgentRecord | None], at_us: int,
                          published: Callable[[str, int], None]) -> list[SendOutcome]:
        """The outcome of each (sender, item), in order. Each recipient's messages (a run) are published
        pipelined, in order (FIFO per pair and per inbox), and settled together (_append_run); different
        recipients' runs at the same time (at most _RUNS_AT_ONCE): a batch waits for a few rounds of
        requests, not for those of every message one after the other (each write is fsynced). One after
        the other throughout when the batch names a (sender, message id) twice or counts a conversation
        budget: which copy is the duplicate, or which message the budget refuses, must not depend on
        timing. `sender_open`: whether each sender not external is open."""
        runs: dict[str, list[int]] = {}
        for index, (_, item) in enumerate(entries):
            runs.setdefault(item.envelope.recipient, []).append(index)
        if self.entries_in_turn([(sender_id, [item]) for sender_id, item in entries]):
            return [await self._append_one(sender_id, sender_open.get(sender_id, True), item, at_us, published)
                    for sender_id, item in entries]
        found: dict[int, SendOutcome] = {}
        room = asyncio.Semaphore(_RUNS_AT_ONCE)

        async def run(indexes: list[int]) -> None:
            async with room:
                run_entries = [entries[i] for i in indexes]
                outcomes = await self._append_run(run_entries, sender_open,
                                                  targets[run_entries[0][1].envelope.recipient], at_us, published)
                found.update(zip(indexes, outcomes))

        if len(runs) == 1:
            await run(next(iter(runs.values())))
            return [found[index] for index in range(len(entries))]
        tasks = [asyncio.ensure_future(run(indexes)) for indexes in runs.values()]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # a NATS failure: stop the other runs, raise it (the client retries by id)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [found[index] for index in range(len(entries))]

    async def _earlier(self, sender_id: str, env: envelope_pb2.Envelope) -> SendOutcome | None:
        """The receipt of an earlier attempt of this message, if it was stored."""
        original = await kv.get(self.conn.msgs, kv.idem_key(sender_id, env.message_id), kv.STORED)
        if original is None:
            return None
        stored = original.value
        state = await kv.get(self.conn.msgs, kv.state_key(stored.recipient, stored.seq), kv.MESSAGE_STATE)
        if state is not None and state.value.state == REJECTED:
            return None  # recorded, then taken back (over capacity, target closed): not stored after all
        return SendOutcome(env.message_id, stored.recipient, DUPLICATE, stored.seq, stored.stored_at_us,
                           "already accepted from this sender; nothing stored again")

    async def _append_run(self, run: list[tuple[str, AppendItem]], sender_open: dict[str, bool],
                          target: AgentRecord | None, at_us: int,
                          published_at: Callable[[str, int], None]) -> list[SendOutcome]:
        """Messages (sender, item) to one recipient (`target`, as read at the start of the append), none
        with a conversation budget, no (sender, message id) twice: the ones not refused published
        pipelined (messages.publish_many), then capacity and a racing close settled once for the run
        while their idempotency records are created."""
        rid = run[0][1].envelope.recipient
        found: list[SendOutcome | None] = [self._refused(sender_id, sender_open.get(sender_id, True), item, target)
                                           for sender_id, item in run]
        refused = [i for i, outcome in enumerate(found) if outcome is not None]
        # a refused send may be the retry of one stored before things changed: that stays a duplicate
        for i, earlier in zip(refused, await asyncio.gather(*(self._earlier(run[i][0], run[i][1].envelope)
                                                              for i in refused))):
            if earlier is not None:
                found[i] = earlier
        todo = [i for i, outcome in enumerate(found) if outcome is None]
        if not todo:
            return [outcome for outcome in found if outcome is not None]
        assert target is not None
        for i in todo:
            sender_id, item = run[i]
            env = item.envelope
            env.sender = sender_id
            env.sequence = 0
            env.stored_at_us = at_us
            env.delivery_attempt = 0
        published = await self.messages.publish_many(rid, [run[i][1].envelope for i in todo], target.inbox_capacity)
        for p in published:
            if p.seq:
                published_at(rid, p.seq)
        stored = [(i, p) for i, p in zip(todo, published) if p.status in (ACCEPTED, DUPLICATE)]
        crash_point("published-unrecorded")  # on the stream, their idempotency records not written yet
        # the idempotency records while capacity and a racing close are settled: the record of a message then
        # taken back names a rejected message, which _earlier does not count
        settled, created = await asyncio.gather(
            self.messages.settle(rid, published, target.inbox_capacity),
            kv.write_many(self.conn, "msgs", [(kv.idem_key(run[i][0], run[i][1].envelope.message_id),
                                               kv.STORED.encode(kv.Stored(rid, p.seq, at_us)), 0)
                                              for i, p in stored]))
        recorded = {i: bool(made) for (i, _), made in zip(stored, created)}
        for i, p in zip(todo, settled):
            sender_id, item = run[i]
            env = item.envelope
            if p.status in (ACCEPTED, DUPLICATE):
                found[i] = await self._settled(sender_id, env, p.status, p.detail, p.seq, recorded[i], at_us)
            else:
                found[i] = SendOutcome(env.message_id, rid, p.status, detail=p.detail)
        return [outcome for outcome in found if outcome is not None]

    def _refused(self, sender_id: str, sender_open: bool, item: AppendItem,
                 target: AgentRecord | None) -> SendOutcome | None:
        """Why this send is refused before it is stored (no conversation budget counted), or None."""
        env = item.envelope
        mid, rid = env.message_id, env.recipient
        if item.rejection is not None:
            return SendOutcome(mid, rid, item.rejection[0], detail=item.rejection[1])
        if not sender_open:
            return SendOutcome(mid, rid, NOT_PERMITTED, detail=f"sender {sender_id} is closed")
        if target is None:
            return SendOutcome(mid, rid, base.UNKNOWN_TARGET, detail=f"no agent {rid}")
        if not target.is_open:
            return SendOutcome(mid, rid, TARGET_CLOSED, detail=f"agent {rid} is closed")
        return None

    async def _settled(self, sender_id: str, env: envelope_pb2.Envelope, status: int, detail: str, seq: int,
                       recorded: bool, at_us: int) -> SendOutcome:
        """The outcome of a message published (ACCEPTED or DUPLICATE by JetStream) whose idempotency record
        was created (`recorded`) or found to exist: then it was stored before, longer ago than
        JetStream's duplicate window, and this copy is taken back."""
        mid, rid = env.message_id, env.recipient
        if not recorded and status == ACCEPTED:
            duplicate = await self._earlier(sender_id, env)
            if duplicate is not None and duplicate.sequence != seq and await self.messages.reject(rid, seq):
                return duplicate
            if duplicate is None:  # the record names a copy taken back: it names this one now
                await kv.cas(self.conn.msgs, kv.idem_key(sender_id, mid), lambda _: kv.Stored(rid, seq, at_us),
                             kv.STORED)
        if status == DUPLICATE:
            return SendOutcome(mid, rid, DUPLICATE, seq, at_us, detail)
        env.sequence = seq
        return SendOutcome(mid, rid, ACCEPTED, seq, at_us, envelope=env)

    async def _append_one(self, sender_id: str, sender_open: bool, item: AppendItem, at_us: int,
                          published: Callable[[str, int], None]) -> SendOutcome:
        """One message on its own (a batch that names a message id twice or counts a conversation budget)."""
        env = item.envelope
        rid = env.recipient
        budgeted = bool(item.conversation_budget and env.conversation_id)
        if budgeted and (duplicate := await self._earlier(sender_id, env)):
            return duplicate  # before the budget is counted: a retry does not use it up
        refusal, capacity = await self._refusal(sender_id, sender_open, item, budgeted)
        if refusal is not None:
            # a refused send may be the retry of one stored before things changed: that stays a duplicate
            return (None if budgeted else await self._earlier(sender_id, env)) or refusal
        env.sender = sender_id
        env.sequence = 0
        env.stored_at_us = at_us
        env.delivery_attempt = 0
        status, detail, seq, _ = await self.messages.publish(rid, env, capacity, tell=False)
        if status not in (ACCEPTED, DUPLICATE):
            return SendOutcome(env.message_id, rid, status, detail=detail)
        published(rid, seq)
        crash_point("published-unrecorded")
        recorded = await kv.create(self.conn.msgs, kv.idem_key(sender_id, env.message_id),
                                   kv.Stored(rid, seq, at_us), kv.STORED)
        return await self._settled(sender_id, env, status, detail, seq, bool(recorded), at_us)

    async def _refusal(self, sender_id: str, sender_open: bool, item: AppendItem,
                       budgeted: bool) -> tuple[SendOutcome | None, int]:
        """Why this send is refused before it is stored (or None), and the
        target's inbox capacity."""
        env = item.envelope
        target = await self.agents.get(env.recipient) if sender_open else None
        refusal = self._refused(sender_id, sender_open, item, target)
        if refusal is not None or target is None:
            return refusal, 0
        if budgeted and not await self._within_budget(env.conversation_id, item.conversation_budget):
            return SendOutcome(env.message_id, env.recipient, NOT_PERMITTED,
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
        # the recipient's record and the first messages at once (what capacity holds back is cut off after)
        agent, read = await asyncio.gather(self.agents.get(recipient),
                                           self.messages.read(recipient, after_sequence + 1, limit))
        ahead: tuple[list[envelope_pb2.Envelope], int] | None = read
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
        envelopes: list[envelope_pb2.Envelope] = []
        dead: list[MessageRecord] = []
        notices: list[envelope_pb2.Envelope] = []
        rows: list[EventRow] = []
        firsts_here: list[envelope_pb2.Envelope] = []
        seq = after_sequence + 1
        more = 1
        try:
            while len(envelopes) + len(dead) < limit:
                want = limit - len(envelopes) - len(dead)
                if ahead is not None:
                    batch, more = ahead[0][:want], ahead[1] + max(0, len(ahead[0]) - want)
                    ahead = None
                else:
                    batch, more = await self.messages.read(recipient, seq, want)
                if not batch:
                    more = 0
                    break
                seq = batch[-1].sequence + 1
                firsts = await self._first_deliveries(recipient, batch, max_attempts, now_us)
                for k, (env, written) in enumerate(zip(batch, firsts)):
                    if written is None:
                        try:
                            written = await self._later_delivery(recipient, env, max_attempts, now_us, dead,
                                                                 notices)
                        except BaseException:  # the firsts after it are not handed out: not counted either
                            for later, counted in zip(batch[k + 1:], firsts[k + 1:]):
                                if counted is not None:
                                    self._unmarked.pop((recipient, later.sequence), None)
                            raise
                        if written is None:
                            continue
                    env.delivery_attempt = written.attempts
                    if env.delivery_attempt == 1:
                        firsts_here.append(env)
                    rows.append(message_event(ev.EVENT_KIND_MESSAGE_DELIVERED, now_us, recipient, env,
                                              detail=f"attempt={env.delivery_attempt}"))
                    envelopes.append(env)
                if not more:
                    break
        except NATS_FAILURES:
            if not envelopes and not dead:
                raise
            more = 1  # what was counted goes out (an attempt counts a delivery made); the rest is read again
        # The sent and stored events before delivered: an append of this process still at work records them
        # (waited for); else copies of the sender's, dropped as such, keep the record in causal order even
        # when this feed is faster than the sender's replica.
        appending = {self._recording[key] for env in firsts_here
                     if (key := (recipient, env.sequence)) in self._recording}
        if appending:
            await _shared_wait(appending)
        copied = {env.sequence: stored_events(env, recipient, env.sequence) for env in firsts_here
                  if self._copies_needed(recipient, env, now_us)}
        earlier = {env.sequence: self._unrecorded.pop((recipient, env.sequence)) for env in envelopes
                   if (recipient, env.sequence) in self._unrecorded}
        # A first delivery whose state entry is not written yet records its event with it (_deferred); any
        # other is recorded before it goes out, after what this process deferred of the message.
        deferring = {env.sequence for env in envelopes if (recipient, env.sequence) in self._unmarked}
        pending = {env.sequence: self._deferred.pop((recipient, env.sequence), []) for env in envelopes
                   if env.sequence not in deferring}
        try:
            await self.events.publish([*(row for rows_of in earlier.values() for row in rows_of),
                                       *(row for rows_of in copied.values() for row in rows_of)], copies=True)
            redelivered = [event for env, row in zip(envelopes, rows) if env.sequence not in deferring
                           for event in (*pending[env.sequence], row)]
            if redelivered:
                await self.events.emit(redelivered)
        except NATS_FAILURES as exc:
            # The attempts are counted (a first one in memory, a later one written): the messages go out all
            # the same, or each failed round would count one more attempt of a message never handed out, and
            # a stream without a leader for some seconds would dead-letter it. Their events are published,
            # as copies, before their consumption (ack_many) or next delivery; the keeper restores them
            # from the state entries if this process dies first.
            log.warning("delivered events of %d messages to %s not recorded yet (%r): recorded before their"
                        " consumption", len(envelopes), recipient, exc)
            for env, row in zip(envelopes, rows):
                self._keep_unrecorded((recipient, env.sequence), [
                    *earlier.get(env.sequence, ()), *copied.get(env.sequence, ()), *pending.get(env.sequence, ()),
                    *self._deferred.pop((recipient, env.sequence), ()), row])
            _trim(self._unrecorded)
        else:
            await self._defer(recipient, [(env.sequence, row) for env, row in zip(envelopes, rows)
                                          if env.sequence in deferring])
        return DeliveryBatch(envelopes, dead, recipient_open=True, notices=notices,
                             held_back=held_back and len(envelopes) + len(dead) >= limit,
                             # with replicas, a full batch's count of what follows is the answering replica's,
                             # which may be behind its leader: not known to be drained then
                             drained=more == 0 and self.conn.config.nats_replicas == 1)

    async def _defer(self, recipient: str, firsts: list[tuple[int, EventRow]]) -> None:
        """Leave the delivered events of first deliveries to be recorded with their state entries (_mark);
        those whose entries were written meanwhile are recorded now. The others' writes failed or lost to
        a consumption elsewhere: kept to go before their consumption through this process (_unrecorded),
        which never comes in the second case (nothing is recorded after a consumption elsewhere)."""
        writing = {self._marking[key] for seq, _ in firsts if (key := (recipient, seq)) in self._marking}
        if writing:
            await _shared_wait(writing)
        late = []
        for seq, row in firsts:
            key = (recipient, seq)
            if key in self._unmarked:
                self._deferred[key] = [*self._deferred.pop(key, ()), row]
            elif key in self._delivered:
                late.append(row)
            else:
                self._keep_unrecorded(key, [row])
        _trim(self._unrecorded)
        await self._record_delivered(late)

    async def _record_delivered(self, rows: list[EventRow]) -> None:
        """Record delivered events; when NATS does not take them, keep them to be published, as copies,
        before their messages' consumption or next delivery (_unrecorded)."""
        if not rows:
            return
        try:
            await self.events.publish(rows)
        except NATS_FAILURES as exc:
            log.warning("delivered events of %d messages not recorded yet (%r): recorded before their"
                        " consumption", len(rows), exc)
            for row in rows:
                self._keep_unrecorded((row.recipient, row.seq), [row])
            _trim(self._unrecorded)

    def _keep_unrecorded(self, key: tuple[str, int], rows: list[EventRow]) -> None:
        """Keep events NATS did not take, after those of the message kept already, to be published as
        copies before its consumption or next delivery (the caller trims _unrecorded)."""
        self._unrecorded[key] = [*self._unrecorded.pop(key, ()), *rows]

    def _recorded_before(self, recipient: str, seq: int) -> list[EventRow]:
        """The events of a message this process has not recorded yet (a failed write's, then a deferred
        delivered one), taken to be published before its dead-lettering."""
        return [*self._unrecorded.pop((recipient, seq), ()), *self._deferred.pop((recipient, seq), ())]

    async def _first_deliveries(self, recipient: str, batch: list[envelope_pb2.Envelope], max_attempts: int,
                                now_us: int) -> list[MessageState | None]:
        """The usual case: messages delivered for the first time. One batched read tells which have a state
        entry; those without get their first attempt, written MARK_DELAY_S later unless an ack writes its
        consumed state first. For each, its state, or None when it is not that (its entry exists, it
        expired, or deliveries are not counted)."""
        firsts: list[MessageState | None] = [None] * len(batch)
        if max_attempts <= 0:
            return firsts
        fresh = [(i, (recipient, env.sequence)) for i, env in enumerate(batch)
                 if not (env.expires_at_us and env.expires_at_us <= now_us)]
        # delivered before by this process and not written yet (a new subscription): written now, counted on
        again = {key for _, key in fresh if key in self._unmarked or key in self._marking}
        if again:
            await self._mark(list(again))
            await _shared_wait(self._marking[key] for key in again if key in self._marking)
        ask = [(i, key) for i, key in fresh if key not in again]
        existing = await asyncio.gather(*(self._has_state.get(kv.state_key(*key)) for _, key in ask))
        for (i, key), exists in zip(ask, existing):
            if not exists:
                firsts[i] = self._unmarked[key] = MessageState.first(batch[i], DELIVERED).first_attempt(now_us)
        if len(self._unmarked) > _UNMARKED_MAX:
            await self._mark(list(self._unmarked))
        elif self._unmarked and self._mark_timer is None:
            self._mark_timer = asyncio.get_running_loop().call_later(MARK_DELAY_S, self._marks_due)
        return firsts

    def _marks_due(self) -> None:
        self._mark_timer = None
        task = asyncio.ensure_future(self._mark(list(self._unmarked)))
        self._mark_tasks.add(task)
        task.add_done_callback(self._marked)

    def _marked(self, task: asyncio.Task[None]) -> None:
        self._mark_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("first deliveries not written (their attempts are not counted): %r", task.exception())

    async def _mark(self, keys: list[tuple[str, int]]) -> None:
        """Write the state entries of the first deliveries of `keys` that are still unmarked, then record
        their delivered events (_deferred); an ack waiting for them (_marking) waits for both."""
        todo = [(key, self._unmarked.pop(key)) for key in keys if key in self._unmarked]
        if not todo:
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key, _ in todo:
            self._marking[key] = done
        try:
            try:
                revisions = await kv.write_many(self.conn, "msgs", [(kv.state_key(*key), first.encode(), 0)
                                                                    for key, first in todo])
            except NATS_FAILURES:  # the attempts are not counted; their events go before their consumption
                for key, _ in todo:
                    if key in self._deferred:
                        self._keep_unrecorded(key, self._deferred.pop(key))
                _trim(self._unrecorded)
                raise
            rows: list[EventRow] = []
            for (key, first), revision in zip(todo, revisions):
                deferred = self._deferred.pop(key, ())
                if revision:
                    self._remember(*key, kv.Entry(first, revision))
                    rows += deferred
                # else somebody wrote first (an ack elsewhere, a close): theirs stands, and its record has
                # no delivery of this attempt before its consumption; none is recorded after it
            await self._record_delivered(rows)
        finally:
            for key, _ in todo:
                self._marking.pop(key, None)
            if not done.done():
                done.set_result(None)

    async def flush_marks(self) -> None:
        """Write every first delivery not written yet, with its delivered event (the store closes)."""
        if self._mark_timer is not None:
            self._mark_timer.cancel()
            self._mark_timer = None
        try:
            await self._mark(list(self._unmarked))
        except NATS_FAILURES as exc:
            log.warning("first deliveries not written at close (their attempts are not counted): %r", exc)
        await asyncio.gather(*self._mark_tasks, return_exceptions=True)

    async def _later_delivery(self, recipient: str, env: envelope_pb2.Envelope, max_attempts: int, now_us: int,
                              dead: list[MessageRecord], notices: list[envelope_pb2.Envelope]) -> MessageState | None:
        """A message whose state entry exists (or that expired): its next attempt written, or None when it is
        final (then deleted from the stream) or dead-lettered now (added to `dead` and `notices`)."""
        key = kv.state_key(recipient, env.sequence)
        found = await kv.get(self.conn.msgs, key, kv.MESSAGE_STATE)
        state = found.value if found else None
        if state is not None and state.final:
            if state.state in (CONSUMED, DEAD_LETTERED):  # its process may have died before its events
                await self._recorded_final(state, env.sequence, now_us)
            await self.messages.delete(env.sequence)
            return None
        attempts = state.attempts if state else 0
        expired = bool(env.expires_at_us and env.expires_at_us <= now_us)
        reason = base.REASON_EXPIRED if expired else (base.REASON_ATTEMPTS if attempts >= max_attempts else "")
        if reason:
            record, notice = await self.dead_letter(recipient, env, reason, now_us)
            if record is not None:
                dead.append(record)
            if notice is not None:
                notices.append(notice)
            return None
        return await kv.cas(self.conn.msgs, key, functools.partial(_next_attempt, env=env, now_us=now_us),
                            kv.MESSAGE_STATE)

    # -- acks -----------------------------------------------------------------------
    async def ack_many(self, entries: list[tuple[str, list[int], int]], at_us: int) -> list[list[AckOutcome]]:
        """Every entry's acks in two rounds of requests, whatever the number of entries: first the state
        changes (compare-and-set) of every distinct sequence of every entry at once; then, together, the
        deletes of what they consumed, all their CONSUMED events (one pipelined publish) and each
        recipient's new frontier. A sequence an entry names twice is answered for its first mention
        and ALREADY_CONSUMED (or the same refusal) after, as one ack after the other would.

        The events go in each recipient's inbox order: for a message final already, copies of the events its
        state stands for (its process may have died, or NATS failed, before they were recorded), dropped
        where recorded; for one consumed now, its CONSUMED event. After a sequence whose ack failed, none
        of that recipient's (what this ack consumed after it is recorded by the retry, which finds it final,
        or by the keeper): a CONSUMED event must not come before that of a message consumed earlier."""
        distinct = [list(dict.fromkeys(sequences)) for _, sequences, _ in entries]
        taken = await self._consume_many([(recipient, seq, turn) for (recipient, _, turn), seqs in
                                          zip(entries, distinct) for seq in sorted(seqs)], at_us)
        failure = next((t for t in taken if isinstance(t, BaseException)), None)
        results = iter(taken)
        answers: list[list[AckOutcome]] = []
        rows: list[EventRow] = []
        deletes: dict[str, list[int]] = {}
        frontiers: dict[str, Frontier] = {}
        copies = False
        for (recipient, sequences, turn), seqs in zip(entries, distinct):
            by_seq: dict[int, tuple[AckOutcome, envelope_pb2.Envelope | None]] = {}
            consumed = []
            failed = False
            for seq in sorted(seqs):  # the record in inbox order: copies of what was final, then new
                result = next(results)
                if isinstance(result, BaseException):
                    failed = True  # what follows is recorded by the retry (its copies), after this one
                    continue
                outcome, env, final, before = result
                by_seq[seq] = (outcome, env)
                if env is not None:
                    consumed.append(env)
                    deletes.setdefault(recipient, []).append(seq)
                    if not failed:
                        unrecorded = self._unrecorded.pop((recipient, seq), None)
                        if unrecorded:  # its delivery's events first (next_deliveries), as copies
                            rows += unrecorded
                            copies = True
                        rows += self._deferred.pop((recipient, seq), ())  # its delivered events, deferred
                        copy = (None if before is None or unrecorded
                                else _delivered_copy(before, recipient, env, seq, at_us))
                        if copy is not None:
                            rows.append(copy)
                            copies = True
                        rows.append(message_event(ev.EVENT_KIND_MESSAGE_CONSUMED, at_us, recipient, env, seq=seq,
                                                  turn=turn))
                elif final is not None and not failed and self._recent(final, at_us):
                    # a delivery of ours deferred is not recorded after its consumption elsewhere (_mark)
                    self._deferred.pop((recipient, seq), None)
                    rows += implied_events(final, seq)
                    copies = True
            if failure is None:
                answers.append(_answers(sequences, by_seq))
            frontier = Frontier.of(consumed)
            if frontier is not None:
                frontiers[recipient] = frontier  # a recipient named again: its later entry's, as in turn
        if rows:
            crash_point("consumed-unrecorded")  # the consumptions are stored, their events not yet
        # The frontiers only guard the agents' next sends, and a final message left on the stream (a
        # crash before its delete) is deleted by the next read of its inbox: all of them go together.
        await asyncio.gather(self.events.publish(rows, copies=copies), self.messages.delete_many(deletes),
                             kv.put_many(self.conn, "msgs", [(frontier_key(recipient),
                                                              json.dumps([f.hop_count, f.trail]).encode())
                                                             for recipient, f in frontiers.items()]))
        if failure is not None:  # what the others consumed is recorded; this one is retried by the client
            raise failure
        return answers

    async def frontier(self, agent_id: str) -> Frontier | None:
        """The agent's frontier as stored now (read after this call began; shared by the sends of one
        agent at about the same time, shared_reads.py)."""
        return await self._frontiers.get(agent_id)

    async def _read_has_state(self, keys: list[str]) -> dict[str, bool]:
        return {key: True for key in await kv.last_many(self.conn, "msgs", keys)}

    async def _read_frontiers(self, agent_ids: list[str]) -> dict[str, Frontier | None]:
        """The frontiers of the agents that have one, in one batched direct get."""
        entries = await kv.last_many(self.conn, "msgs", [frontier_key(a) for a in agent_ids])
        found: dict[str, Frontier | None] = {}
        for agent_id in agent_ids:
            entry = entries.get(frontier_key(agent_id))
            if entry is not None:
                hop_count, trail = json.loads(entry.value)
                found[agent_id] = Frontier(hop_count, tuple(trail))
        return found

    async def _consume_many(self, acks: list[tuple[str, int, int]], at_us: int) -> list[Any]:
        """The outcome of each (recipient, sequence, turn) ack (as _consume's), or the NATS failure it met.
        The usual case, a message this process delivered and remembers, is written at once (pipelined
        compare-and-set writes, one request each); the others, and any that lost a race, one by one
        (_consume)."""
        results: list[Any] = [None] * len(acks)
        fast: list[tuple[int, MessageState, int]] = []
        writing = {self._marking[(r, seq)] for r, seq, _ in acks if (r, seq) in self._marking}
        if writing:  # a first delivery's state being written: it is remembered once written
            await _shared_wait(writing)
        for k, (recipient, seq, turn) in enumerate(acks):
            unmarked = self._unmarked.pop((recipient, seq), None)
            if unmarked is not None:  # delivered and not written yet: the consumed state is its first write
                fast.append((k, unmarked.consumed(at_us, turn), 0))
                continue
            remembered = self._delivered.pop((recipient, seq), None)
            if remembered is not None and not remembered.value.final:
                fast.append((k, remembered.value.consumed(at_us, turn), remembered.revision))
        try:
            revisions = await kv.write_many(self.conn, "msgs", [
                (kv.state_key(acks[k][0], acks[k][1]), new.encode(), revision) for k, new, revision in fast])
        except NATS_FAILURES as exc:  # some may be written: a retry of those finds them consumed
            revisions = []
            for k, _, _ in fast:
                results[k] = exc
        for (k, new, _), revision in zip(fast, revisions):
            if revision:
                env = new.envelope_pb()
                results[k] = (AckOutcome(acks[k][1], env.message_id, inbox_pb2.ACK_STATUS_CONSUMED,
                                         env.trace.traceparent, env), env, None, None)
        slow = [k for k, result in enumerate(results) if result is None]
        for k, result in zip(slow, await asyncio.gather(*(self._consume(*acks[k][:2], at_us, acks[k][2])
                                                          for k in slow), return_exceptions=True)):
            results[k] = result
        return results

    async def _consume(self, recipient: str, seq: int, at_us: int, turn: int) -> tuple[
            AckOutcome, envelope_pb2.Envelope | None, MessageState | None, MessageState | None]:
        """The outcome of acking one message (its state entry set to consumed by compare-and-set), the
        envelope when this ack consumed it (ack_many deletes it from the stream), the state when the
        message was final already (ack_many records copies of the events it stands for), and, for a message
        consumed now, its state before (QUEUED when it had no entry): this one-by-one path is for messages
        this process does not remember delivering (_consume_many takes those), so another process may have
        delivered it and not recorded that yet (ack_many records a copy of a first delivery's event first,
        _delivered_copy; a copy of a recorded one is dropped)."""
        msgs = self.conn.msgs
        key = kv.state_key(recipient, seq)
        remembered = self._delivered.pop((recipient, seq), None)
        for _ in range(kv.MAX_CAS_TRIES):
            found, remembered = remembered or await kv.get(msgs, key, kv.MESSAGE_STATE), None
            if found is not None:
                state = found.value
                if state.state in (CONSUMED, DEAD_LETTERED):  # ack_many records copies of its events
                    status = (inbox_pb2.ACK_STATUS_ALREADY_CONSUMED if state.state == CONSUMED
                              else inbox_pb2.ACK_STATUS_DEAD_LETTERED)
                    return AckOutcome(seq, state.message_id, status), None, state, None
                if state.state == REJECTED:
                    return AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND), None, None, None
                new = state.consumed(at_us, turn)
                if await kv.write(msgs, key, new.encode(), found.revision) is CasResult.LOST:
                    continue
                env = new.envelope_pb()
            else:
                fresh = await self.messages.envelope_at(recipient, seq)
                if fresh is None:
                    return AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND), None, None, None
                env = fresh
                state = MessageState.first(env, QUEUED)
                if not await kv.create(msgs, key, state.consumed(at_us, turn), kv.MESSAGE_STATE):
                    continue
            return (AckOutcome(seq, env.message_id, inbox_pb2.ACK_STATUS_CONSUMED, env.trace.traceparent, env), env,
                    None, state)
        raise errors.Unavailable(f"too much contention acking {seq} in {recipient}'s inbox", reason=Reason.CONTENTION)

    async def _recorded_final(self, state: MessageState, seq: int, now_us: int) -> None:
        """Before an ack is answered that the message was final already: copies of the events its state
        stands for (events.implied_events), dropped as copies where recorded. The write that made it final
        may not have recorded them (its process died, or NATS failed it after the state was written, as
        when an ack is answered UNAVAILABLE and written again): the keeper records them a second or more
        later, after the events of what the agent consumed meanwhile, out of causal order. Not for a
        state older than the duplicate window allows (a copy would be recorded twice)."""
        if self._recent(state, now_us):
            await self.events.publish(implied_events(state, seq), copies=True)

    @staticmethod
    def _recent(state: MessageState, now_us: int) -> bool:
        """Whether a final state is recent enough for copies of its events (older ones would be recorded
        twice: the duplicate window would not drop them)."""
        return (state.consumed_at_us if state.state == CONSUMED else state.dead_at_us) >= now_us - REPLAY_HORIZON_US

    # -- dead letters ---------------------------------------------------------------
    async def dead_letter(self, recipient: str, env: envelope_pb2.Envelope, reason: str,
                          at_us: int) -> tuple[MessageRecord | None, envelope_pb2.Envelope | None]:
        """Dead-letter one message unless its state is already final; tell
        its sender. Returns (record, notice)."""
        msgs = self.conn.msgs
        delivered = self._unmarked.pop((recipient, env.sequence), None)  # not written now: dead instead
        die = functools.partial(_dead, env=env, at_us=at_us, reason=reason, delivered=delivered)
        written = await kv.cas(msgs, kv.state_key(recipient, env.sequence), die, kv.MESSAGE_STATE)
        if written is None:
            return None, None
        await self.messages.delete(env.sequence)
        await kv.cas(msgs, f"dr.{kv.token(recipient)}", lambda cur: [*(cur or []), env.sequence], kv.JSON)
        await kv.cas(msgs, f"ds.{kv.token(env.sender)}", lambda cur: [*(cur or []), [recipient, env.sequence]],
                     kv.JSON)
        await self.events.emit([*self._recorded_before(recipient, env.sequence), dead_event(at_us, recipient, env,
                                                                                             reason)])
        notice = None
        if notices_of.wanted(env, recipient):
            if notices_of.crosses(env):  # to an IOA sender: through the outbox, which the relay sends
                entry = notices_of.crossing(env, recipient, reason, at_us)
                added, = await self._outbox.add([entry], OUTBOX_LIMIT)
                await self.events.emit(notices_of.crossing_events(entry, added.number, env, at_us))
            elif not env.sender.startswith(base.EXTERNAL_PREFIXES):
                notice = await self._notice(env, recipient, reason, at_us)
        return written.record(), notice

    async def _notice(self, dead: envelope_pb2.Envelope, recipient: str, reason: str,
                      at_us: int) -> envelope_pb2.Envelope | None:
        sender = await kv.read_agent(self.conn.agents, dead.sender)
        if sender is None or not sender.is_open:
            return None
        notice = notices_of.notice(dead, recipient, reason, at_us)
        notice.stored_at_us = at_us
        message_id = notice.message_id
        status, detail, seq, _ = await self.messages.publish(dead.sender, notice, sender.inbox_capacity)
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
        status, _, seq, _ = await self.messages.publish(run.requester_id, env, requester.inbox_capacity)
        if status == INBOX_FULL:
            held = await self.messages.unconsumed(run.requester_id)
            return AnnounceStored(Announce.FULL, f"requester {run.requester_id}'s inbox is full ({held} of"
                                                 f" {requester.inbox_capacity}); retrying")
        if status == TARGET_CLOSED:
            return AnnounceStored(Announce.GONE, f"requester {run.requester_id} is closed")
        if not await kv.create(self.conn.msgs, idem, kv.Stored(run.requester_id, seq, at_us), kv.STORED):
            # stored by an earlier attempt whose Nats-Msg-Id JetStream forgot (consumed, then a restart):
            # this copy is taken back, as a send's is (_settled)
            earlier = await self._earlier(run.child_id, env)
            if earlier is not None and earlier.sequence != seq and await self.messages.reject(run.requester_id, seq):
                return AnnounceStored(Announce.STORED, "duplicate: stored by an earlier attempt", earlier.sequence)
        return AnnounceStored(Announce.STORED,
                              "accepted" if status == ACCEPTED else "duplicate: stored by an earlier attempt", seq)

    # -- queries ----------------------------------------------------------------------
    async def by_inbox(self, recipient: str, seq: int) -> MessageRecord | None:
        """The message's record as the leaders of the streams have it (kv.get_latest)."""
        found = await kv.get_latest(self.conn, "msgs", kv.state_key(recipient, seq), kv.MESSAGE_STATE)
        if found is not None:
            return None if found.value.state == REJECTED else found.value.record()
        unmarked = self._unmarked.get((recipient, seq))
        if unmarked is not None:  # delivered here, its state not written yet
            return unmarked.record()
        env = await self.messages.envelope_at(recipient, seq, latest=True)
        if env is None:
            return None
        return MessageRecord(envelope=env, state=QUEUED, attempts=0, stored_at_us=env.stored_at_us)

    async def by_sender(self, sender: str, message_id: str) -> MessageRecord | None:
        found = await kv.get_latest(self.conn, "msgs", kv.idem_key(sender, message_id), kv.STORED)
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
