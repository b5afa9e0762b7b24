"""The keeper of the JetStream store: an operation that a mesh process
started and did not finish (it was killed between two writes) is finished
by another, and no event is lost.

On JetStream an operation is several writes: a message's state change and
its event; an agent record, its index entries and its event; a close and
the dead letters, run end and closes of descendants that follow it; a run
record, its index entries and its events. So:

- every event of a state change has a deterministic identity (`dedup_id`, events.py:
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
the record. It is told of the events recorded meanwhile, as the watchers
are (events.py: this process's as it records them, the other processes'
from their notices), and publishes only the implied events whose identity
it was not told of in the last `SEEN_S`: where the writer finished, that is
none. An event it was not told of (a notice lost, a process killed between
its write and its notice) is published again and dropped by the duplicate
window, a request for both sides. Until 2026-12-07 it read the events
stream back instead (batched direct gets of every event): about a tenth of
a mesh process's CPU at 64 in flight went to that and to parsing the
headers of what it read. It also keeps
the idempotency records of final messages: nats-server forgets the
`Nats-Msg-Id` of a deleted message when it restarts or a stream's leader
changes (its duplicate tracking is rebuilt from the stored messages), so a
consumed message whose idempotency record was never written (its process
died between the publish and that write) would be stored again by a retry;
for a consumed or dead-lettered message whose record it has not seen
written, the keeper creates it (create-if-absent, as the writer would). A write
older than the duplicate window (less a margin) when the keeper reaches it
is not replayed, nor an implied event that old (a message stored minutes
before it was consumed), since its copy could no longer be told from the
original: a lost write that old takes every mesh process down for minutes,
and is logged with a count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from inboxmesh.common.v1 import envelope_pb2
from services.store.base import CONSUMED, DEAD_LETTERED, EventRow, RunRecord
from services.store.jetstream import kv
from services.store.jetstream.agents import Agents
from services.store.jetstream.connection import (
    EVENT_DEDUP_WINDOW_S,
    NATS_FAILURES,
    REPLAY_HORIZON_US,
    JetStreamConnection,
)
from services.store.jetstream.events import EventLog, dedup_id, implied_events
from services.store.jetstream.kv import CasResult, MessageState
from services.store.jetstream.runs import Runs

log = logging.getLogger(__name__)
LEASE_S = 6.0
TICK_S = 1.0
LAG_S = 1.0
_BATCH = 256
_KEY = "event-keeper"
SEEN_S = 30.0
"""How long the identity of an event the keeper was told of is remembered (it does not publish it again
meanwhile)."""
IDEM_SEEN = 200_000
"""Idempotency records seen written that the keeper remembers until their message is final (oldest
forgotten first: a record forgotten is created again, which changes nothing)."""


@dataclass(frozen=True)
class Lease:
    """The keeper's lease (bucket misc, key `event-keeper`): who keeps the store until when, and per
    bucket the stream sequence up to which its writes were rolled forward."""

    owner: str
    until: float
    cursors: dict[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps({"owner": self.owner, "until": self.until, "cursors": self.cursors}).encode()

    @staticmethod
    def decode(data: bytes) -> Lease:
        fields = json.loads(data)
        return Lease(fields["owner"], fields["until"], dict(fields.get("cursors") or {}))


LEASE: kv.Codec[Lease] = kv.Codec(Lease.decode, Lease.encode)
Handler = Callable[[list[Any]], Awaitable[list[EventRow]]]
"""A batch of one bucket's writes (in order) -> the events they imply, once rolled forward."""


class _Source:
    """One bucket's writes the keeper follows."""

    def __init__(self, name: str, prefix: str, handle: Handler):
        self.name, self.prefix, self.handle = name, prefix, handle
        self.pull: Any = None
        self.next_seq = 0  # the stream sequence `pull` reads from next
        self.held: list[Any] = []  # fetched writes younger than LAG_S

    async def drop(self) -> None:
        pull, self.pull = self.pull, None
        self.held = []
        if pull is not None:
            try:
                await pull.unsubscribe()
            except NATS_FAILURES as exc:  # the consumer goes anyway (inactive_threshold)
                log.debug("keeper: unsubscribing failed: %r", exc)


class EventKeeper:
    """Follows the writes to message states, agents and runs (one process at a time) and rolls each
    forward with the parts that made it (agents, runs), publishing the events it implies."""

    def __init__(self, conn: JetStreamConnection, events: EventLog, agents: Agents, runs: Runs):
        self.conn = conn
        self.events = events
        self.agents = agents
        self.runs = runs
        self.instance = secrets.token_hex(8)
        self.replayed = 0
        """Writes this process rolled forward (most needed nothing)."""
        self.restored = 0
        """Events the keeper published that were not there yet."""
        self.too_old = 0
        self._seen: dict[str, float] = {}
        """Identities (dedup_id) of the events told of while this process holds the lease, and when (oldest
        first)."""
        self._holding = False
        events.listeners.append(self._told)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._idem_seen: dict[tuple[str, int], None] = {}
        """(recipient, seq) of the idempotency records written since this process follows the msgs bucket."""
        self._idem_missing: list[tuple[str, bytes, int]] = []
        """Idempotency records to create (key, value, 0) at the end of the batch being rolled forward."""
        self.idem_restored = 0
        """Idempotency records the keeper created (their writer died first)."""
        self._sources = [_Source("msgs", "", self._messages_written),  # states (m.), idempotency records (i.)
                         _Source("agents", "a.", self._agents_written),
                         _Source("runs", "r.", self._runs_written)]

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="event-keeper")

    async def stop(self) -> None:
        """Stop the loop. It also ends by a flag: on Python 3.11 a cancel that
        meets a nats-py request finishing at the same moment is lost inside
        asyncio.wait_for, and the loop would go on. Safe to call twice, and
        before start."""
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
                    self._seen, self._holding = {}, False
                else:
                    self._holding = True
                    self._forget_seen()
                    done = {s.name: await self._replay(s, cursors[s.name]) for s in self._sources}
                    if done != cursors:
                        await self._lease(done)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away, or a write it cannot roll forward yet: the next tick retries
                log.warning("keeper: %r; trying again", exc)
                for source in self._sources:
                    await source.drop()
            await asyncio.sleep(TICK_S)

    async def _lease(self, cursors: dict[str, int] | None) -> dict[str, int] | None:
        """Take or renew the lease (saving `cursors` when given); the cursors
        to go on from, or None when another live process holds the lease."""
        now = time.time()
        found = await kv.get(self.conn.misc, _KEY, LEASE)
        current = found.value if found else None
        if current is not None and current.owner != self.instance and current.until > now:
            return None
        if cursors is None:
            cursors = dict(current.cursors) if current else {}
            for source in self._sources:  # a bucket never followed before: from its newest write on
                if source.name not in cursors:
                    info = await self.conn.js.stream_info(self.conn.kv_stream(source.name))
                    cursors[source.name] = info.state.last_seq
        lease = Lease(self.instance, now + LEASE_S, cursors)
        if await kv.write(self.conn.misc, _KEY, lease.encode(), found.revision if found else 0) is CasResult.LOST:
            return None  # another process took it just now
        return cursors

    def _told(self, event_id: int, rows: list[EventRow]) -> None:
        """An event recorded (EventLog's listener): its identity is remembered while this process keeps the
        store."""
        if self._holding:
            now = time.monotonic()
            for row in rows:
                ident = dedup_id(row)
                if ident:
                    self._seen[ident] = now

    def _forget_seen(self) -> None:
        """Forget the identities told of more than SEEN_S ago."""
        now = time.monotonic()
        while self._seen:
            oldest = next(iter(self._seen))
            if now - self._seen[oldest] <= SEEN_S:
                break
            del self._seen[oldest]

    def _unrecorded(self, rows: list[EventRow]) -> list[EventRow]:
        """The implied events to publish: not told of lately, and not so old that a copy would be recorded
        twice."""
        oldest = int(time.time() * 1_000_000) - REPLAY_HORIZON_US
        return [row for row in rows if row.at_us >= oldest and (dedup_id(row) or "") not in self._seen]

    async def _replay(self, source: _Source, cursor: int) -> int:
        """Roll forward the writes after `cursor` that are old enough; the new cursor."""
        if source.pull is None or source.next_seq != cursor + 1:
            await source.drop()
            source.pull = await self.conn.js.pull_subscribe(
                f"$KV.{self.conn.ns}_{source.name}.{source.prefix}>", stream=self.conn.kv_stream(source.name),
                config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=cursor + 1,
                                      ack_policy=AckPolicy.NONE, inactive_threshold=30.0, mem_storage=True))
            source.next_seq = cursor + 1
        if len(source.held) < _BATCH:
            try:
                source.held += await source.pull.fetch(_BATCH - len(source.held), timeout=0.2)
            except TimeoutError:  # nats.errors.TimeoutError too: nothing new
                pass
        now = time.time()
        done = cursor
        writes: list[Any] = []
        while source.held:
            msg = source.held[0]
            meta = msg.metadata
            written = meta.timestamp.timestamp()
            if now - written < LAG_S:
                break
            if now - written > EVENT_DEDUP_WINDOW_S - 30:
                self.too_old += 1
            elif not (msg.headers or {}).get("KV-Operation") and msg.data:
                writes.append(msg)
                self.replayed += 1
            source.held.pop(0)
            done = meta.sequence.stream
            source.next_seq = done + 1
        rows = await source.handle(writes) if writes else []
        if self._idem_missing:
            missing, self._idem_missing = self._idem_missing, []
            self.idem_restored += sum(map(bool, await kv.write_many(self.conn, "msgs", missing)))
        rows = self._unrecorded(rows)
        if rows:
            self.restored += sum(not ack.duplicate for ack in await self.events.publish(rows, copies=True))
        return done

    async def _message_written(self, msg: Any) -> list[EventRow]:
        key = msg.subject[len(self.conn.kv_subject("msgs", "")):]
        try:
            if key.startswith("i."):
                stored = kv.STORED.decode(msg.data)
                self._idem_seen[(stored.recipient, stored.seq)] = None
                while len(self._idem_seen) > IDEM_SEEN:
                    del self._idem_seen[next(iter(self._idem_seen))]
                return []
            if not key.startswith("m."):
                return []
            seq = int(key.rpartition(".")[2])
            state = MessageState.decode(msg.data)
            if state.state in (CONSUMED, DEAD_LETTERED) and state.envelope is not None:
                self._final(state, seq)
            return implied_events(state, seq)
        except (ValueError, TypeError, KeyError, DecodeError):
            return []

    def _final(self, state: MessageState, seq: int) -> None:
        """A message is final (its copy on the stream is deleted): its idempotency record is created if this
        process has not seen it written."""
        env = envelope_pb2.Envelope.FromString(state.envelope or b"")
        if self._idem_seen.pop((env.recipient, seq), 0) is None:
            return
        self._idem_missing.append((kv.idem_key(env.sender, env.message_id),
                                   kv.STORED.encode(kv.Stored(env.recipient, seq, state.stored_at_us)), 0))

    async def _agents_written(self, msgs: list[Any]) -> list[EventRow]:
        """Agent records written: rolled forward together, each agent once (from its record as it is now)."""
        agent_ids = []
        for msg in msgs:
            try:
                agent_ids.append(json.loads(msg.data)["agent_id"])
            except (ValueError, TypeError, KeyError):
                continue
        return await self.agents.roll_forward(agent_ids)

    async def _runs_written(self, msgs: list[Any]) -> list[EventRow]:
        """Run records written: rolled forward at the same time (their index writes shared, an atomic batch
        when there are many), each run once, their events in the order of the writes."""
        run_ids = []
        for msg in msgs:
            try:
                run_ids.append(RunRecord.FromString(msg.data).run_id)
            except DecodeError:
                continue
        done = await asyncio.gather(*(self.runs.roll_forward(run_id) for run_id in dict.fromkeys(run_ids)))
        return [row for rows in done for row in rows]

    async def _messages_written(self, msgs: list[Any]) -> list[EventRow]:
        rows: list[EventRow] = []
        for msg in msgs:
            rows += await self._message_written(msg)
        return rows
