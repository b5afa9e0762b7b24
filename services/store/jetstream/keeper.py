"""The keeper of the JetStream store: an operation that a mesh process
started and did not finish (it was killed between two writes) is finished
by another, and no event is lost.

On JetStream an operation is several writes: a message's state change and
its event; an agent record, its index entries and its event; a close and
the dead letters, run end and closes of descendants that follow it; a run
record, its index entries and its events. So:

- every event of a state change has a deterministic identity (`dedup_id`:
  kind, and the message (recipient, inbox sequence, attempt), agent or run
  it is about), published as its `Nats-Msg-Id`; the events stream drops a
  second copy within its duplicate window;
- one mesh process at a time (a lease in the `misc` bucket, taken over when
  its holder stops renewing it) reads every write to message state
  entries, agent records and run records, in stream order, and rolls each
  forward: it repeats the steps that follow that write (each one can be
  repeated: compare-and-set, create-if-absent, de-duplicated publishes) and
  publishes the events it implies. Where the process that made the change
  finished it, the repeats change nothing and JetStream drops the copies;
  where it died first, the keeper finishes it.

The keeper reads a write only once it is `LAG_S` old, so the event the
changing process publishes normally lands first and keeps its place in
the record. A write older than the duplicate window (less a margin) when
the keeper reaches it is not replayed, since its copy could no longer be
told from the original: that takes every mesh process down for minutes,
and is logged with a count.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from inboxmesh.client.tracing import trace_id_of
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from services.store import base
from services.store.base import CONSUMED, DEAD_LETTERED, DELIVERED, RunRecord, event_row
from services.store.jetstream import kv as kvh

log = logging.getLogger(__name__)
EVENT_DEDUP_WINDOW_S = 300.0
"""Duplicate window of the events stream: how long a replayed event is recognised."""
LEASE_S = 6.0
TICK_S = 1.0
LAG_S = 1.0
_BATCH = 256
_KEY = "event-keeper"
_NOTICE_PREFIX = base.RESERVED_ID_PREFIX + "notice:"
_SENT, _STORED = ev.EVENT_KIND_MESSAGE_SENT, ev.EVENT_KIND_MESSAGE_STORED
_DELIVERED, _CONSUMED = ev.EVENT_KIND_MESSAGE_DELIVERED, ev.EVENT_KIND_MESSAGE_CONSUMED
_DEAD = ev.EVENT_KIND_MESSAGE_DEAD_LETTERED
ACCEPTED_NAME = "accepted"
"""The detail of the sent event of an accepted message (the receipt's name)."""


_ONCE_PER_AGENT = (ev.EVENT_KIND_AGENT_REGISTERED, ev.EVENT_KIND_AGENT_CLOSED)
_ONCE_PER_RUN = (ev.EVENT_KIND_RUN_CREATED, ev.EVENT_KIND_RUN_STARTED, ev.EVENT_KIND_RUN_ENDED,
                 ev.EVENT_KIND_RUN_ANNOUNCED, ev.EVENT_KIND_RUN_REQUESTER_GONE, ev.EVENT_KIND_RUN_CLEANED_UP,
                 ev.EVENT_KIND_RUN_ARCHIVED)


def dedup_id(row: tuple) -> str | None:
    """The identity of an event that happens once per message state, agent
    or run (None for events that have none): the same event published twice
    gets the same id."""
    kind, recipient, seq, detail = row[1], row[5], row[6], row[7]
    if kind in _ONCE_PER_AGENT:
        return f"ev:{kind}:{row[2]}"
    if kind in _ONCE_PER_RUN:
        return f"ev:{kind}:{row[3]}"  # run events carry the run id as message_id
    if seq <= 0 or not recipient:
        return None
    if kind in (_STORED, _CONSUMED, _DEAD) or (kind == _SENT and detail == ACCEPTED_NAME):
        return f"ev:{kind}:{recipient}:{seq}"  # one accepted send per stored message
    if kind == _DELIVERED:
        return f"ev:{kind}:{recipient}:{seq}:{detail}"
    return None


def stored_events(env: envelope_pb2.Envelope, recipient: str, seq: int) -> list[tuple]:
    """The sent and stored events of a message accepted into `recipient`'s
    inbox at `seq`, as the process that stored it recorded them (a
    dead-letter notice has no sent event: the mesh sent it)."""
    mid, sender, trace_id = env.message_id, env.sender, trace_id_of(env.trace.traceparent)
    if mid.startswith(_NOTICE_PREFIX):
        return [event_row(env.stored_at_us, _STORED, recipient, message_id=mid, sender=sender, recipient=recipient,
                          seq=seq, trace_id=trace_id, detail="dead-letter notice", in_reply_to=env.in_reply_to)]
    common = dict(message_id=mid, sender=sender, recipient=recipient, seq=seq, trace_id=trace_id,
                  in_reply_to=env.in_reply_to, conversation_id=env.conversation_id)
    return [event_row(env.stored_at_us, _SENT, recipient, detail=ACCEPTED_NAME, **common),
            event_row(env.stored_at_us, _STORED, recipient, **common)]


def implied_events(state: dict, seq: int) -> list[tuple]:
    """The events a message state entry (of the message at `seq`) stands for:
    sent and stored, each delivery attempt, then consumed or dead-lettered,
    as the process that wrote it would have recorded them."""
    if state.get("state") not in (DELIVERED, CONSUMED, DEAD_LETTERED) or "env" not in state:
        return []
    env = envelope_pb2.Envelope.FromString(base64.b64decode(state["env"]))
    recipient = env.recipient
    env.stored_at_us = env.stored_at_us or state["stored"]
    trace_id = trace_id_of(env.trace.traceparent)
    mid, sender = env.message_id, env.sender
    rows = stored_events(env, recipient, seq)
    delivered_at = state.get("delivered") or state["stored"]
    for attempt in range(1, state.get("attempts", 0) + 1):
        rows.append(event_row(delivered_at, _DELIVERED, recipient, message_id=mid, sender=sender, recipient=recipient,
                              seq=seq, detail=f"attempt={attempt}", trace_id=trace_id, in_reply_to=env.in_reply_to,
                              conversation_id=env.conversation_id))
    if state["state"] == CONSUMED:
        rows.append(event_row(state["consumed"], _CONSUMED, recipient, message_id=mid, sender=sender,
                              recipient=recipient, seq=seq, trace_id=trace_id, turn=state.get("turn", 0),
                              in_reply_to=env.in_reply_to, conversation_id=env.conversation_id))
    elif state["state"] == DEAD_LETTERED:
        rows.append(event_row(state["dead"], _DEAD, recipient, message_id=mid, sender=sender, recipient=recipient,
                              seq=seq, detail=state.get("reason", ""), trace_id=trace_id))
    return rows


class _Source:
    """One bucket's writes the keeper follows."""

    def __init__(self, name: str, prefix: str, handle):
        self.name, self.prefix, self.handle = name, prefix, handle
        self.pull = None
        self.next_seq = 0  # the stream sequence `pull` reads from next
        self.held: list = []  # fetched writes younger than LAG_S

    async def drop(self) -> None:
        pull, self.pull = self.pull, None
        self.held = []
        if pull is not None:
            try:
                await pull.unsubscribe()
            except Exception:
                pass


class EventKeeper:
    def __init__(self, store):
        self.store = store
        self.instance = secrets.token_hex(8)
        self.replayed = 0
        """Writes this process rolled forward (most needed nothing)."""
        self.restored = 0
        """Events the keeper published that were not there yet."""
        self.too_old = 0
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._sources = [_Source("msgs", "m.", self._message_written),
                         _Source("agents", "a.", self._agent_written),
                         _Source("runs", "r.", self._run_written)]

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="event-keeper")

    async def stop(self) -> None:
        """Stop the loop. It also ends by a flag: on Python 3.11 a cancel that
        meets a nats-py request finishing at the same moment is lost inside
        asyncio.wait_for, and the loop would go on."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=TICK_S + 5)
        for source in self._sources:
            await source.drop()

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                cursors = await self._lease(None)
                if cursors is None:
                    for source in self._sources:
                        await source.drop()  # another process keeps the store
                else:
                    done = {s.name: await self._replay(s, cursors[s.name]) for s in self._sources}
                    if done != cursors:
                        await self._lease(done)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("keeper: %r; trying again", exc)
                for source in self._sources:
                    await source.drop()
            await asyncio.sleep(TICK_S)

    def _stream(self, source: _Source) -> str:
        return f"KV_{self.store.ns}_{source.name}"

    async def _lease(self, cursors: dict[str, int] | None) -> dict[str, int] | None:
        """Take or renew the lease (saving `cursors` when given); the cursors
        to go on from, or None when another live process holds the lease."""
        now = time.time()
        found = await kvh.get(self.store.misc, _KEY)
        current, revision = found if found else (None, 0)
        if current is not None and current["owner"] != self.instance and current["until"] > now:
            return None
        if cursors is None:
            cursors = dict((current or {}).get("cursors") or {})
            for source in self._sources:  # a bucket never followed before: from its newest write on
                if source.name not in cursors:
                    cursors[source.name] = (await self.store.js.stream_info(self._stream(source))).state.last_seq
        value = json.dumps({"owner": self.instance, "until": now + LEASE_S, "cursors": cursors}).encode()
        try:
            if current is None:
                await self.store.misc.create(_KEY, value)
            else:
                await self.store.misc.update(_KEY, value, last=revision)
        except Exception:
            return None  # another process took it just now
        return cursors

    async def _replay(self, source: _Source, cursor: int) -> int:
        """Roll forward the writes after `cursor` that are old enough; the new cursor."""
        if source.pull is None or source.next_seq != cursor + 1:
            await source.drop()
            source.pull = await self.store.js.pull_subscribe(
                f"$KV.{self.store.ns}_{source.name}.{source.prefix}>", stream=self._stream(source),
                config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=cursor + 1,
                                      ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True))
            source.next_seq = cursor + 1
        if len(source.held) < _BATCH:
            try:
                source.held += await source.pull.fetch(_BATCH - len(source.held), timeout=0.2)
            except TimeoutError:
                pass
            except Exception as exc:
                if "timeout" not in type(exc).__name__.lower():
                    raise
        now = time.time()
        done = cursor
        rows: list[tuple] = []
        while source.held:
            msg = source.held[0]
            meta = msg.metadata
            written = meta.timestamp.timestamp()
            if now - written < LAG_S:
                break
            if now - written > EVENT_DEDUP_WINDOW_S - 30:
                self.too_old += 1
            elif not (msg.headers or {}).get("KV-Operation") and msg.data:
                rows += await source.handle(msg)
                self.replayed += 1
            source.held.pop(0)
            done = meta.sequence.stream
            source.next_seq = done + 1
        if rows:
            self.restored += sum(not ack.duplicate for ack in await self.store.publish_events(rows))
        return done

    async def _message_written(self, msg) -> list[tuple]:
        try:
            return implied_events(json.loads(msg.data), int(msg.subject.rpartition(".")[2]))
        except (ValueError, TypeError, KeyError):
            return []

    async def _agent_written(self, msg) -> list[tuple]:
        try:
            agent_id = json.loads(msg.data)["agent_id"]
        except (ValueError, TypeError, KeyError):
            return []
        return await self.store.roll_forward_agent(agent_id)

    async def _run_written(self, msg) -> list[tuple]:
        try:
            run_id = RunRecord.FromString(msg.data).run_id
        except Exception:
            return []
        return await self.store.roll_forward_run(run_id)
