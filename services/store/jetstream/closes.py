"""Closes made by any mesh process on the JetStream store, found from the writes to agent records.

An agent record (bucket agents, key `a.<agent>`) is written when the agent is registered, when its
credential changes and when it is closed; the stream behind the bucket keeps those writes in order. A
delivery stream follows them after a cursor (a stream sequence) to learn of closes made by another
replica: one fetch per call from a pull consumer kept between calls, so a call costs the writes made
since the cursor, never one read per agent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.store.base import Closes
from services.store.jetstream import kv
from services.store.jetstream.connection import NATS_FAILURES, JetStreamConnection

log = logging.getLogger(__name__)
_WAIT_S = 0.2
"""How long a fetch waits for writes when none is there yet."""
_INACTIVE_S = 120.0
"""NATS removes the consumer after this long without a fetch (its mesh gone away). A call after half of
that without one makes a new consumer rather than fetch from one that may be gone."""


class CloseFollower:
    """Reads the agents bucket's record writes after a cursor and picks out the closes."""

    def __init__(self, conn: JetStreamConnection):
        self.conn = conn
        self._pull: Any = None
        self._next_seq = 0
        """The stream sequence `_pull` delivers next."""
        self._used_at = 0.0

    async def closes_since(self, cursor: int | None, limit: int) -> Closes:
        stream = self.conn.kv_stream("agents")
        if cursor is None:
            info = await self.conn.js.stream_info(stream)
            return Closes([], int(info.state.last_seq))
        try:
            msgs = await self._fetch(cursor, limit)
        except NATS_FAILURES:
            await self.drop()  # removed while idle, or NATS failed: one new consumer from the cursor
            msgs = await self._fetch(cursor, limit)
        closed = []
        for msg in msgs:
            cursor = msg.metadata.sequence.stream
            record = kv.written_agent(msg)
            if record is not None and not record.is_open:
                closed.append((record.agent_id, record.close_reason))
        assert cursor is not None
        self._next_seq = cursor + 1
        return Closes(closed, cursor, more=len(msgs) >= limit)

    async def _fetch(self, cursor: int, limit: int) -> list[Any]:
        now = time.monotonic()
        if self._pull is None or self._next_seq != cursor + 1 or now - self._used_at > _INACTIVE_S / 2:
            await self.drop()
            self._pull = await self.conn.js.pull_subscribe(
                f"$KV.{self.conn.ns}_agents.a.>", stream=self.conn.kv_stream("agents"),
                config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=cursor + 1,
                                      ack_policy=AckPolicy.NONE, inactive_threshold=_INACTIVE_S,
                                      mem_storage=True))
            self._next_seq = cursor + 1
        self._used_at = now
        try:
            return list(await self._pull.fetch(limit, timeout=_WAIT_S))
        except TimeoutError:  # nats.errors.TimeoutError too: nothing written since the cursor
            return []

    async def drop(self) -> None:
        """Let go of the consumer (the next call makes a new one). Safe to call twice."""
        pull, self._pull = self._pull, None
        if pull is not None:
            try:
                await pull.unsubscribe()
            except NATS_FAILURES as exc:  # the consumer goes anyway (inactive threshold)
                log.debug("close follower: unsubscribing failed: %r", exc)
