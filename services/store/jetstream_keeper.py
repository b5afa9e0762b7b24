"""The event keeper of the JetStream store: no message event is lost when a
mesh process dies between a state change and the event that records it.

On JetStream a state change (a message's state entry in the `msgs` bucket)
and its event (on the events stream) are two writes. A process killed
between them leaves the state right and the event record short. So:

- every message event has a deterministic identity (`dedup_id`: kind,
  recipient, inbox sequence, and the attempt for deliveries), published as
  its `Nats-Msg-Id`; the events stream drops a second copy within its
  duplicate window;
- one mesh process at a time (a lease in the `misc` bucket, taken over when
  its holder stops renewing it) reads every write to message state entries,
  in stream order, and publishes the events that write implies (stored,
  each delivery attempt, consumed or dead-lettered). Where the process that
  made the change published them already, JetStream drops the copies; where
  it died first, the keeper's copy is the event.

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

from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from services.store import base
from services.store import jetstream_kv as kvh
from services.store.base import CONSUMED, DEAD_LETTERED, DELIVERED, event_row
from services.telemetry import trace_id_of

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


def dedup_id(row: tuple) -> str | None:
    """The identity of a message event (None for events that have none):
    the same event published twice gets the same id."""
    kind, recipient, seq, detail = row[1], row[5], row[6], row[7]
    if seq <= 0 or not recipient:
        return None
    if kind in (_STORED, _CONSUMED, _DEAD):
        return f"ev:{kind}:{recipient}:{seq}"
    if kind == _DELIVERED:
        return f"ev:{kind}:{recipient}:{seq}:{detail}"
    return None


def implied_events(state: dict, recipient: str, seq: int) -> list[tuple]:
    """The events a message state entry stands for: stored, each delivery
    attempt, then consumed or dead-lettered, as the process that wrote it
    would have recorded them."""
    if state.get("state") not in (DELIVERED, CONSUMED, DEAD_LETTERED) or "env" not in state:
        return []
    env = envelope_pb2.Envelope.FromString(base64.b64decode(state["env"]))
    trace_id = trace_id_of(env.trace.traceparent)
    mid, sender = env.message_id, env.sender
    rows = []
    if not mid.startswith(base.ANNOUNCE_ID_PREFIX):  # an announce has no stored event of its own
        notice = mid.startswith(_NOTICE_PREFIX)
        rows.append(event_row(state["stored"], _STORED, recipient, message_id=mid, sender=sender, recipient=recipient,
                              seq=seq, trace_id=trace_id, detail="dead-letter notice" if notice else "",
                              in_reply_to=env.in_reply_to, conversation_id="" if notice else env.conversation_id))
    delivered_at = state.get("delivered") or state["stored"]
    for attempt in range(1, state.get("attempts", 0) + 1):
        rows.append(event_row(delivered_at, _DELIVERED, recipient, message_id=mid, sender=sender, recipient=recipient,
                              seq=seq, detail=f"attempt={attempt}", trace_id=trace_id))
    if state["state"] == CONSUMED:
        rows.append(event_row(state["consumed"], _CONSUMED, recipient, message_id=mid, sender=sender,
                              recipient=recipient, seq=seq, trace_id=trace_id, turn=state.get("turn", 0)))
    elif state["state"] == DEAD_LETTERED:
        rows.append(event_row(state["dead"], _DEAD, recipient, message_id=mid, sender=sender, recipient=recipient,
                              seq=seq, detail=state.get("reason", ""), trace_id=trace_id))
    return rows


class EventKeeper:
    def __init__(self, store):
        self.store = store
        self.instance = secrets.token_hex(8)
        self.replayed = 0
        """Writes whose events this process replayed (most are dropped as copies)."""
        self.restored = 0
        """Events the keeper published that were not there yet."""
        self.too_old = 0
        self._task: asyncio.Task | None = None
        self._pull = None
        self._next_seq = 0  # the stream sequence self._pull reads from next
        self._held: list = []  # fetched writes younger than LAG_S

    @property
    def stream(self) -> str:
        return f"KV_{self.store.ns}_msgs"

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="event-keeper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await self._drop_pull()

    async def _drop_pull(self) -> None:
        pull, self._pull = self._pull, None
        self._held = []
        if pull is not None:
            try:
                await pull.unsubscribe()
            except Exception:
                pass

    async def _loop(self) -> None:
        while True:
            try:
                cursor = await self._lease(None)
                if cursor is None:
                    await self._drop_pull()  # another process keeps the events
                else:
                    done = await self._replay(cursor)
                    if done != cursor:
                        await self._lease(done)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event keeper: %r; trying again", exc)
                await self._drop_pull()
            await asyncio.sleep(TICK_S)

    async def _lease(self, cursor: int | None) -> int | None:
        """Take or renew the lease (saving `cursor` when given); the cursor to
        go on from, or None when another live process holds the lease."""
        now = time.time()
        found = await kvh.get(self.store.misc, _KEY)
        current, revision = found if found else (None, 0)
        if current is not None and current["owner"] != self.instance and current["until"] > now:
            return None
        if cursor is None:
            cursor = current["cursor"] if current else (await self.store.js.stream_info(self.stream)).state.last_seq
        value = json.dumps({"owner": self.instance, "until": now + LEASE_S, "cursor": cursor}).encode()
        try:
            if current is None:
                await self.store.misc.create(_KEY, value)
            else:
                await self.store.misc.update(_KEY, value, last=revision)
        except Exception:
            return None  # another process took it just now
        return cursor

    async def _replay(self, cursor: int) -> int:
        """Replay the writes after `cursor` that are old enough; the new cursor."""
        if self._pull is None or self._next_seq != cursor + 1:
            await self._drop_pull()
            self._pull = await self.store.js.pull_subscribe(
                f"$KV.{self.store.ns}_msgs.m.>", stream=self.stream, config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=cursor + 1,
                    ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True))
            self._next_seq = cursor + 1
        if len(self._held) < _BATCH:
            try:
                self._held += await self._pull.fetch(_BATCH - len(self._held), timeout=0.2)
            except asyncio.TimeoutError:
                pass
            except Exception as exc:
                if "timeout" not in type(exc).__name__.lower():
                    raise
        now = time.time()
        done = cursor
        rows: list[tuple] = []
        while self._held:
            msg = self._held[0]
            meta = msg.metadata
            written = meta.timestamp.timestamp() if hasattr(meta.timestamp, "timestamp") else float(meta.timestamp)
            if now - written < LAG_S:
                break
            self._held.pop(0)
            done = meta.sequence.stream
            self._next_seq = done + 1
            if (msg.headers or {}).get("KV-Operation") or not msg.data:
                continue
            if now - written > EVENT_DEDUP_WINDOW_S - 30:
                self.too_old += 1
                continue
            try:
                state = json.loads(msg.data)
                env = envelope_pb2.Envelope.FromString(base64.b64decode(state["env"])) if "env" in state else None
            except (ValueError, TypeError):
                continue
            if env is None:
                continue
            seq = msg.subject.rpartition(".")[2]
            rows += implied_events(state, env.recipient, int(seq))
            self.replayed += 1
        if rows:
            self.restored += sum(not ack.duplicate for ack in await self.store.publish_events(rows))
        return done
