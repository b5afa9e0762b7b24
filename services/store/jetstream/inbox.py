"""Inbox operations of the JetStream store: append with receipts, delivery
from the stream, exactly-once acks, dead letters.

A message's state entry (bucket im_msgs, key `m.<agent>.<seq>`) is the
arbiter: it is created or changed only by compare-and-set, so of an ack, a
dead-lettering close and a send that finds its target closed, exactly one
wins. The message leaves the stream once its state is final (consumed, dead
or rejected), which keeps the per-subject count equal to what is unconsumed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING

from nats.js.errors import APIError, NotFoundError

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
    TARGET_CLOSED,
    AckOutcome,
    AppendItem,
    DeliveryBatch,
    Frontier,
    MessageRecord,
    RunRecord,
    SendOutcome,
    event_row,
)
from services.store.jetstream import kv as kvh
from services.store.jetstream.keeper import stored_events
from services.store.sqlite.inbox import RECEIPT_NAME

if TYPE_CHECKING:
    from services.store.jetstream.store import JetStreamStore

log = logging.getLogger(__name__)
REJECTED = 0
"""State of a message its sender was refused after all (target closed, over capacity)."""
FINAL = (CONSUMED, DEAD_LETTERED, REJECTED)
FULL_CODE = 10077
"""JetStream: maximum messages per subject exceeded."""
_MESH_ORIGIN = envelope_pb2.Origin(kind=envelope_pb2.ORIGIN_KIND_MESH)
_REMEMBERED = 50_000
"""First-delivery states kept per process for the acks that follow (oldest dropped first)."""


def state_key(agent_id: str, seq: int) -> str:
    return f"m.{kvh.token(agent_id)}.{seq}"


def frontier_key(agent_id: str) -> str:
    """The agent's loop-guard Frontier: [hop_count, trail] of what it consumed last."""
    return f"fr.{kvh.token(agent_id)}"


class InboxLog:
    def __init__(self, store: JetStreamStore):
        self.store = store
        self.listeners: list = []
        """Called with the recipient's subject token when any process appended to it."""
        self._delivered: dict[tuple[str, int], tuple[dict, int]] = {}

    def _remember(self, recipient: str, seq: int, state: dict, revision: int) -> None:
        """The state entry this process wrote at a first delivery, so the ack
        that usually follows can change it without reading it first."""
        self._delivered[(recipient, seq)] = (state, revision)
        if len(self._delivered) > _REMEMBERED:
            self._delivered.pop(next(iter(self._delivered)))

    def subject(self, agent_id: str) -> str:
        return f"{self.store.ns}.inbox.{kvh.token(agent_id)}"

    @property
    def js(self):
        return self.store.js

    @property
    def msgs(self):
        return self.store.msgs

    async def on_published(self, msg) -> None:
        token = msg.subject.rsplit(".", 1)[-1]
        for callback in self.listeners:
            callback(token)

    # -- reading the stream --------------------------------------------------------
    async def _next(self, recipient: str, seq: int):
        try:
            return await self.js.get_msg(self.store.inbox_stream, seq=seq, subject=self.subject(recipient), next=True, direct=True)
        except NotFoundError:
            return None

    async def envelope_at(self, recipient: str, seq: int) -> envelope_pb2.Envelope | None:
        msg = await self._next(recipient, seq)
        if msg is None or msg.seq != seq:
            return None
        return self._envelope(msg)

    @staticmethod
    def _envelope(msg) -> envelope_pb2.Envelope:
        envelope = envelope_pb2.Envelope.FromString(msg.data)
        envelope.sequence = msg.seq
        return envelope

    async def _delete(self, seq: int) -> None:
        """Remove a final message from the stream (frees its inbox's capacity).
        `no_erase`: the default overwrites the bytes on disk first, which
        costs nats-server about 5 times the CPU (0.7 ms against 0.15 ms), and
        the message's state entry keeps the envelope anyway."""
        await self.store.nc.request(f"$JS.API.STREAM.MSG.DELETE.{self.store.inbox_stream}",
                                    json.dumps({"seq": seq, "no_erase": True}).encode(),
                                    timeout=self.store.config.nats_timeout_s)
        # an error answer (already gone) needs nothing more

    async def _unconsumed(self, recipient: str) -> int:
        info = await self.js.stream_info(self.store.inbox_stream, subjects_filter=self.subject(recipient))
        return (info.state.subjects or {}).get(self.subject(recipient), 0)

    # -- append ---------------------------------------------------------------------
    async def _publish(self, recipient, envelope: envelope_pb2.Envelope, capacity: int) -> tuple[int, str, int]:
        """Put the envelope on the recipient's subject: (status, detail, seq)."""
        msg_id = kvh.msg_id_header(envelope.sender, envelope.message_id)
        while True:
            try:
                ack = await self.js.publish(self.subject(recipient), envelope.SerializeToString(),
                                            headers={"Nats-Msg-Id": msg_id})
            except APIError as exc:
                if exc.err_code == FULL_CODE:
                    return INBOX_FULL, self._full(recipient, capacity, capacity), 0
                raise
            if not ack.duplicate:
                break
            earlier = await kvh.get(self.msgs, state_key(recipient, ack.seq))
            if earlier is None or earlier[0]["state"] != REJECTED:
                return DUPLICATE, "already accepted from this sender; nothing stored again", ack.seq
            # JetStream remembers an attempt that was refused after all: a retry is a new attempt
            msg_id = f"{kvh.msg_id_header(envelope.sender, envelope.message_id)}#{ack.seq}"
        if capacity < self.store.config.max_inbox_capacity:
            held = await self._unconsumed(recipient)
            if held > capacity and await self._reject(recipient, ack.seq):
                return INBOX_FULL, self._full(recipient, held - 1, capacity), 0
        now_open = await self.store.get_agent(recipient)
        if now_open is not None and not now_open.is_open and await self._reject(recipient, ack.seq):
            return TARGET_CLOSED, f"agent {recipient} is closed", 0
        return ACCEPTED, "", ack.seq

    @staticmethod
    def _full(recipient: str, held: int, capacity: int) -> str:
        return (f"agent {recipient} holds {held} unconsumed messages (capacity {capacity}); nothing was evicted,"
                " retry after it consumes")

    async def _reject(self, recipient: str, seq: int) -> bool:
        """Take a just-published message back; False when a close already
        dead-lettered it (then it stays accepted)."""
        if await kvh.create(self.msgs, state_key(recipient, seq), {"state": REJECTED}):
            await self._delete(seq)
            return True
        return False

    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        store = self.store
        sender_open = True
        if not sender_id.startswith(base.EXTERNAL_PREFIXES):
            sender = await store.get_agent(sender_id)
            sender_open = sender is not None and sender.is_open
        outcomes: list[SendOutcome] = []
        rows: list[tuple] = []
        for item in items:
            outcome = await self._append_one(sender_id, sender_open, item, at_us)
            env = item.envelope
            common = dict(message_id=env.message_id, sender=sender_id, recipient=outcome.recipient,
                          seq=outcome.sequence, trace_id=trace_id_of(env.trace.traceparent),
                          in_reply_to=env.in_reply_to, conversation_id=env.conversation_id)
            rows.append(event_row(at_us, ev.EVENT_KIND_MESSAGE_SENT, outcome.recipient,
                                  detail=RECEIPT_NAME[outcome.status], **common))
            if outcome.status == ACCEPTED:
                rows.append(event_row(at_us, ev.EVENT_KIND_MESSAGE_STORED, env.recipient, **common))
            outcomes.append(outcome)
        await store.emit(rows)
        return outcomes

    async def _append_one(self, sender_id: str, sender_open: bool, item: AppendItem, at_us: int) -> SendOutcome:
        env = item.envelope
        mid, rid = env.message_id, env.recipient
        idem = kvh.idem_key(sender_id, mid)

        async def earlier() -> SendOutcome | None:
            """The receipt of an earlier attempt of this message, if it was stored."""
            original = await kvh.get(self.msgs, idem)
            if original is None:
                return None
            recipient, seq, stored = original[0]
            return SendOutcome(mid, recipient, DUPLICATE, seq, stored,
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
        status, detail, seq = await self._publish(rid, env, capacity)
        if status not in (ACCEPTED, DUPLICATE):
            return SendOutcome(mid, rid, status, detail=detail)
        if not await kvh.create(self.msgs, idem, [rid, seq, at_us]) and status == ACCEPTED:
            # stored before, longer ago than JetStream's duplicate window: take this copy back
            duplicate = await earlier()
            if duplicate is not None and duplicate.sequence != seq and await self._reject(rid, seq):
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
        target = await self.store.get_agent(rid)
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
        counted = await kvh.cas(self.store.misc, f"conv.{kvh.token(conversation_id)}",
                                lambda cur: None if (cur or 0) >= budget else (cur or 0) + 1)
        return counted is not None

    # -- delivery -------------------------------------------------------------------
    async def next_deliveries(self, recipient: str, after_sequence: int, limit: int, max_attempts: int,
                              now_us: int, in_flight: int = 0) -> DeliveryBatch:
        agent = await self.store.get_agent(recipient)
        if agent is None or not agent.is_open:
            return DeliveryBatch([], [], recipient_open=False,
                                 close_reason=agent.close_reason if agent else "unknown agent")
        if agent.inbox_capacity < self.store.config.max_inbox_capacity:
            # A sender settles capacity after publishing (_publish): a message beyond the first `capacity`
            # unconsumed ones may still be taken back, so it is not delivered (that would make the take-back
            # fail and the inbox hold more than its capacity). It is delivered once acks make room.
            room = agent.inbox_capacity - in_flight
            if room <= 0:
                return DeliveryBatch([], [], recipient_open=True, held_back=True)
            held_back, limit = room < limit, min(limit, room)
        else:
            held_back = False
        envelopes: list[envelope_pb2.Envelope] = []
        dead: list[MessageRecord] = []
        notices: list[envelope_pb2.Envelope] = []
        rows: list[tuple] = []
        seq = after_sequence + 1
        while len(envelopes) + len(dead) < limit:
            msg = await self._next(recipient, seq)
            if msg is None:
                break
            seq = msg.seq + 1
            env = self._envelope(msg)
            key = state_key(recipient, msg.seq)
            expired = bool(env.expires_at_us and env.expires_at_us <= now_us)

            def deliver(cur, env=env):
                if cur is not None and cur["state"] in FINAL:
                    return None
                base_state = cur or {"state": QUEUED, "attempts": 0, "stored": env.stored_at_us,
                                     "env": kvh.envelope_b64(env)}
                return {**base_state, "state": DELIVERED, "attempts": base_state["attempts"] + 1,
                        "delivered": base_state.get("delivered") or now_us}

            written = None
            if not expired and max_attempts > 0:  # the usual case, a first delivery: one request
                first = deliver(None)
                revision = await kvh.create(self.msgs, key, first)
                if revision:
                    written = first
                    self._remember(recipient, msg.seq, first, revision)
            if written is None:
                found = await kvh.get(self.msgs, key)
                state = found[0] if found else None
                if state is not None and state["state"] in FINAL:
                    await self._delete(msg.seq)
                    continue
                attempts = state["attempts"] if state else 0
                reason = base.REASON_EXPIRED if expired else (
                    base.REASON_ATTEMPTS if attempts >= max_attempts else "")
                if reason:
                    record, notice = await self.dead_letter(recipient, env, reason, now_us)
                    if record is not None:
                        dead.append(record)
                    if notice is not None:
                        notices.append(notice)
                    continue
                written = await kvh.cas(self.msgs, key, deliver)
                if written is None:
                    continue
            env.delivery_attempt = written["attempts"]
            if env.delivery_attempt == 1:
                # the sent and stored events first (copies of the sender's, dropped as such): the record
                # stays in causal order even when this feed is faster than the sender's replica
                rows += stored_events(env, recipient, env.sequence)
            rows.append(event_row(now_us, ev.EVENT_KIND_MESSAGE_DELIVERED, recipient, message_id=env.message_id,
                                  sender=env.sender, recipient=recipient, seq=env.sequence,
                                  detail=f"attempt={env.delivery_attempt}",
                                  trace_id=trace_id_of(env.trace.traceparent), in_reply_to=env.in_reply_to,
                                  conversation_id=env.conversation_id))
            envelopes.append(env)
        await self.store.emit(rows)  # before the subscriber can ack: consumed always follows delivered
        return DeliveryBatch(envelopes, dead, recipient_open=True, notices=notices,
                             held_back=held_back and len(envelopes) + len(dead) >= limit)

    # -- acks -----------------------------------------------------------------------
    async def ack(self, recipient: str, sequences: list[int], at_us: int, turn: int) -> list[AckOutcome]:
        outcomes = []
        rows = []
        consumed = []
        for seq in sequences:
            outcome, env = await self._ack_one(recipient, seq, at_us, turn)
            if env is not None:
                consumed.append(env)
                rows.append(event_row(at_us, ev.EVENT_KIND_MESSAGE_CONSUMED, recipient, message_id=env.message_id,
                                      sender=env.sender, recipient=recipient, seq=seq,
                                      trace_id=trace_id_of(env.trace.traceparent), turn=turn,
                                      in_reply_to=env.in_reply_to, conversation_id=env.conversation_id))
            outcomes.append(outcome)
        if rows:
            crash_point("consumed-unrecorded")  # the consumption is stored, its event not yet
        frontier = Frontier.of(consumed)
        if frontier is None:
            await self.store.emit(rows)
        else:  # written beside the events (one round trip): it only guards the agent's next sends
            value = json.dumps([frontier.hop_count, frontier.trail]).encode()
            await asyncio.gather(self.msgs.put(frontier_key(recipient), value), self.store.emit(rows))
        return outcomes

    async def frontier(self, agent_id: str) -> Frontier | None:
        found = await kvh.get(self.msgs, frontier_key(agent_id))
        return None if found is None else Frontier(found[0][0], tuple(found[0][1]))

    async def _ack_one(self, recipient: str, seq: int, at_us: int,
                       turn: int) -> tuple[AckOutcome, envelope_pb2.Envelope | None]:
        """The outcome, and the envelope when this ack consumed it."""
        key = state_key(recipient, seq)
        remembered = self._delivered.pop((recipient, seq), None)
        for _ in range(kvh.MAX_CAS_TRIES):
            found, remembered = remembered or await kvh.get(self.msgs, key), None
            if found is not None:
                state, revision = found
                if state["state"] == CONSUMED:
                    return AckOutcome(seq, _mid(state), inbox_pb2.ACK_STATUS_ALREADY_CONSUMED), None
                if state["state"] == DEAD_LETTERED:
                    return AckOutcome(seq, _mid(state), inbox_pb2.ACK_STATUS_DEAD_LETTERED), None
                if state["state"] == REJECTED:
                    return AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND), None
                new = {**state, "state": CONSUMED, "consumed": at_us, "turn": turn}
                try:
                    await self.msgs.update(key, json.dumps(new).encode(), last=revision)
                except Exception:
                    continue
                env = kvh.message_of(new).envelope
            else:
                env = await self.envelope_at(recipient, seq)
                if env is None:
                    return AckOutcome(seq, "", inbox_pb2.ACK_STATUS_NOT_FOUND), None
                new = {"state": CONSUMED, "attempts": 0, "stored": env.stored_at_us, "consumed": at_us, "turn": turn,
                       "env": kvh.envelope_b64(env)}
                if not await kvh.create(self.msgs, key, new):
                    continue
            await self._delete(seq)
            return AckOutcome(seq, env.message_id, inbox_pb2.ACK_STATUS_CONSUMED, env.trace.traceparent, env), env
        raise errors.Unavailable(f"too much contention acking {seq} in {recipient}'s inbox", reason=Reason.CONTENTION)

    # -- dead letters ---------------------------------------------------------------
    async def dead_letter(self, recipient: str, env: envelope_pb2.Envelope, reason: str,
                          at_us: int) -> tuple[MessageRecord | None, envelope_pb2.Envelope | None]:
        """Dead-letter one message unless its state is already final; tell
        its sender. Returns (record, notice)."""

        def die(cur):
            if cur is not None and cur["state"] in FINAL:
                return None
            state = cur or {"attempts": 0, "stored": env.stored_at_us, "env": kvh.envelope_b64(env)}
            return {**state, "state": DEAD_LETTERED, "dead": at_us, "reason": reason}

        written = await kvh.cas(self.msgs, state_key(recipient, env.sequence), die)
        if written is None:
            return None, None
        await self._delete(env.sequence)
        await kvh.cas(self.msgs, f"dr.{kvh.token(recipient)}", lambda cur: [*(cur or []), env.sequence])
        await kvh.cas(self.msgs, f"ds.{kvh.token(env.sender)}", lambda cur: [*(cur or []), [recipient, env.sequence]])
        await self.store.emit([event_row(at_us, ev.EVENT_KIND_MESSAGE_DEAD_LETTERED, recipient,
                                         message_id=env.message_id, sender=env.sender, recipient=recipient,
                                         seq=env.sequence, detail=reason,
                                         trace_id=trace_id_of(env.trace.traceparent))])
        notice = None
        if env.origin.kind != envelope_pb2.ORIGIN_KIND_MESH and env.sender != recipient \
                and not env.sender.startswith(base.EXTERNAL_PREFIXES):
            notice = await self._notice(env, recipient, reason, at_us)
        return kvh.message_of(written), notice

    async def _notice(self, dead: envelope_pb2.Envelope, recipient: str, reason: str,
                      at_us: int) -> envelope_pb2.Envelope | None:
        sender = await self.store.get_agent(dead.sender)
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
        status, detail, seq = await self._publish(dead.sender, notice, sender.inbox_capacity)
        if status != ACCEPTED:
            await self.store.emit([event_row(at_us, ev.EVENT_KIND_NOTICE_UNDELIVERED, dead.sender,
                                             message_id=message_id, sender=recipient, recipient=dead.sender,
                                             detail=f"{'inbox full' if status == INBOX_FULL else detail};"
                                                    f" {dead.message_id} was dead-lettered: {reason}")])
            return None
        await kvh.create(self.msgs, kvh.idem_key(recipient, message_id), [dead.sender, seq, at_us])
        notice.sequence = seq
        await self.store.emit([event_row(at_us, ev.EVENT_KIND_MESSAGE_STORED, dead.sender, message_id=message_id,
                                         sender=recipient, recipient=dead.sender, seq=seq,
                                         detail="dead-letter notice", trace_id=trace_id_of(dead.trace.traceparent),
                                         in_reply_to=dead.message_id)])
        return notice

    async def dead_letter_all(self, recipient: str, reason: str,
                              at_us: int) -> tuple[list[MessageRecord], list[envelope_pb2.Envelope]]:
        dead, notices = [], []
        seq = 1
        while True:
            msg = await self._next(recipient, seq)
            if msg is None:
                return dead, notices
            seq = msg.seq + 1
            record, notice = await self.dead_letter(recipient, self._envelope(msg), reason, at_us)
            if record is not None:
                dead.append(record)
            if notice is not None:
                notices.append(notice)

    # -- announce ---------------------------------------------------------------------
    async def store_announce(self, run: RunRecord, env: envelope_pb2.Envelope, at_us: int) -> tuple[str, str, int]:
        """("stored", "accepted" | "duplicate: ...", seq), ("full", detail, 0)
        or ("gone", detail, 0)."""
        idem = kvh.idem_key(run.child_id, env.message_id)
        found = await kvh.get(self.msgs, idem)
        if found is not None:
            return "stored", "duplicate: stored by an earlier attempt", found[0][1]
        requester = await self.store.get_agent(run.requester_id)
        if requester is None:
            return "gone", f"requester {run.requester_id} does not exist", 0
        if not requester.is_open:
            return "gone", f"requester {run.requester_id} is closed ({requester.close_reason})", 0
        env.stored_at_us = at_us
        status, detail, seq = await self._publish(run.requester_id, env, requester.inbox_capacity)
        if status == INBOX_FULL:
            held = await self._unconsumed(run.requester_id)
            return "full", (f"requester {run.requester_id}'s inbox is full ({held} of {requester.inbox_capacity});"
                            " retrying"), 0
        if status == TARGET_CLOSED:
            return "gone", f"requester {run.requester_id} is closed", 0
        await kvh.create(self.msgs, idem, [run.requester_id, seq, at_us])
        return "stored", "accepted" if status == ACCEPTED else "duplicate: stored by an earlier attempt", seq

    # -- queries ----------------------------------------------------------------------
    async def by_inbox(self, recipient: str, seq: int) -> MessageRecord | None:
        found = await kvh.get(self.msgs, state_key(recipient, seq))
        if found is not None:
            return None if found[0]["state"] == REJECTED else kvh.message_of(found[0])
        env = await self.envelope_at(recipient, seq)
        if env is None:
            return None
        return MessageRecord(envelope=env, state=QUEUED, attempts=0, stored_at_us=env.stored_at_us)

    async def by_sender(self, sender: str, message_id: str) -> MessageRecord | None:
        found = await kvh.get(self.msgs, kvh.idem_key(sender, message_id))
        if found is None:
            return None
        recipient, seq, _ = found[0]
        return await self.by_inbox(recipient, seq)

    async def dead_letters(self, *, recipient: str, sender: str, after_key: str,
                           limit: int) -> tuple[list[MessageRecord], str]:
        try:
            start = int(after_key or 0)
        except ValueError:
            raise errors.InvalidArgument(f"page_token {after_key!r} is not valid",
                                         reason=Reason.BAD_PAGE_TOKEN) from None
        if sender:
            found = await kvh.get(self.msgs, f"ds.{kvh.token(sender)}")
            keys = [tuple(k) for k in (found[0] if found else [])]
        else:
            found = await kvh.get(self.msgs, f"dr.{kvh.token(recipient)}")
            keys = [(recipient, s) for s in (found[0] if found else [])]
        page = keys[start:start + limit]
        records = await asyncio.gather(*(self.by_inbox(r, s) for r, s in page))
        return [r for r in records if r is not None], (str(start + limit) if len(page) == limit else "")


def _mid(state: dict) -> str:
    return kvh.message_of(state).envelope.message_id if "env" in state else ""
