"""What this mesh process knows of the agent records (bucket agents, key `a.<agent_id>`), kept by a watch
of the bucket, so that a send need not read its targets' records from NATS before it publishes, nor a
delivery its recipient's.

A copy may be behind the bucket (a record another process wrote a moment ago, a watch that NATS cut off
and that is starting again), and is trusted only as far as that is safe:

- an agent the copy does not hold is read from the bucket (then held);
- a closed record is final: an agent never opens again, and its capacity never changes;
- an open record may be out of date. A send's target read open from the copy is read again from the
  bucket once the message is published (InboxMessages.settle and publish, as for a close that raced the
  send before this copy existed) and the message taken back if it is closed by then; a delivery to an
  agent closed meanwhile by another process is ended by that close (the hub follows closes,
  closes.py). The sender of a send is never taken from the copy: a closed sender is refused before
  anything is published, since a message taken back after its publish may have been delivered already.

The copy holds at most AGENTS_HELD records (beyond that, records not held are read each time).

Reads that must see the bucket as it is now (a send's sender before the publish, its target after:
`fresh`) are shared by the sends that want the same agent at about the same time (shared_reads.py). A
send's sender is read beside its frontier (JetStreamStore.get_frontier), once the mesh took the request,
and the append takes that read (`since`): one round trip before the publish, not two.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from nats.js.api import DeliverPolicy

from services.store.base import AgentRecord
from services.store.jetstream import kv
from services.store.jetstream.connection import NATS_FAILURES, JetStreamConnection
from services.store.jetstream.shared_reads import BatchedReads, SharedReads

log = logging.getLogger(__name__)
AGENTS_HELD = 200_000
"""Agent records the copy holds at most (about 0.5 KB each)."""
_RETRY_S = 1.0
"""How long the watch waits before it starts again after NATS refused it."""


class AgentCache:
    """Agent records as the watch of the agents bucket last saw them (or this process last wrote them)."""

    def __init__(self, conn: JetStreamConnection):
        self.conn = conn
        self._records: dict[str, AgentRecord] = {}
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self.reads = 0
        """Records read from the bucket because the copy did not hold them."""
        learn = self._learn_fresh
        self._fresh: SharedReads[AgentRecord | None] | BatchedReads[AgentRecord | None] = (
            BatchedReads(self._read_many, None, learn, recent=True) if conn.config.nats_replicas == 1 else
            SharedReads(lambda agent_id: kv.read_agent(conn.agents, agent_id), learn, recent=True))
        """Reads of the bucket as it is now (`fresh`): with one replica, the agents asked for at about the same
        time in one batched direct get; with more, one read of the leader per agent (a direct get may be
        answered by a follower behind it)."""

    def _learn_fresh(self, record: AgentRecord | None) -> None:
        """A record read as it is now updates the copy."""
        if record is not None:
            self.learn(record)

    async def _read_many(self, agent_ids: list[str]) -> dict[str, AgentRecord | None]:
        entries = await kv.last_many(self.conn, "agents", [kv.agent_key(a) for a in agent_ids])
        return {a: kv.AGENT.decode(entries[kv.agent_key(a)].value) for a in agent_ids if kv.agent_key(a) in entries}

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="agent-cache")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._unsubscribe()

    async def _watch(self) -> None:
        """Subscribe to every record write of the bucket (its last one per agent first); nats-py's ordered
        consumer starts again after a gap or a lost connection by itself; this task tries again while NATS
        refuses to start it."""
        while self._sub is None:
            try:
                self._sub = await self.conn.js.subscribe(
                    self.conn.kv_subject("agents", "a.>"), stream=self.conn.kv_stream("agents"),
                    cb=self._on_write, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
            except NATS_FAILURES as exc:
                log.info("agent cache: watch not started (%r); trying again", exc)
                await asyncio.sleep(_RETRY_S)

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()
            except NATS_FAILURES as exc:  # the ordered consumer is ephemeral: NATS removes it anyway
                log.debug("agent cache: unsubscribing failed: %r", exc)

    async def _on_write(self, msg: Any) -> None:
        record = kv.written_agent(msg)  # records are never removed: a delete or purge has nothing to learn
        if record is not None:
            self.learn(record)

    def learn(self, record: AgentRecord) -> None:
        """Take a record written (seen by the watch, or written by this process). An older write seen
        after a close does not open the agent again."""
        held = self._records.get(record.agent_id)
        if held is not None and not held.is_open:
            return
        if held is None and len(self._records) >= AGENTS_HELD:
            return
        self._records[record.agent_id] = record

    async def get(self, agent_id: str) -> AgentRecord | None:
        """The agent's record as the copy holds it, else as the bucket holds it now (None: no such agent)."""
        held = self._records.get(agent_id)
        if held is not None:
            return held
        self.reads += 1
        record = await kv.read_agent(self.conn.agents, agent_id)
        if record is not None:
            self.learn(record)
        return record

    async def fresh(self, agent_id: str, since: float = math.inf) -> AgentRecord | None:
        """The agent's record as the bucket holds it now: read after this call began, or at `since`
        (time.monotonic()) or later (None: no such agent). The record read is held, as a write seen by the
        watch is."""
        return await self._fresh.get(agent_id, since)

    def held(self, agent_id: str) -> AgentRecord | None:
        return self._records.get(agent_id)
