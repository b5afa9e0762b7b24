"""Writes into one stream shared by the callers that make them at about the same time, as the SQLite
writer shares a commit and shared_reads.py shares a read: at most one flush per stream is in flight, and
the writes that come while it is wait for the next, which starts when it ends and takes all of them (up
to BATCH_MAX messages). A flush of at least BATCH_MIN messages goes as one atomic batch (one answer and
one write on the server for all of them); a smaller one, or a batch JetStream refuses (a message id it
has stored already, a key written by somebody else first, an inbox at its limit), one message at a time,
pipelined, so each message gets its own answer. A flush starts at the loop's next turn, with every write
queued in this one; a lone write waits for that turn only.

Each caller's messages keep their order in the stream; the messages of callers that wrote at the same
time follow each other in the order they came. Sixty-four sends at once put their messages, their
idempotency records and their events into a few batches, not 64 of each (`bench/nats_requests.py
--in-flight 64`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.js.api import PubAck
from nats.js.errors import APIError

log = logging.getLogger(__name__)

BATCH_MAX = 500
"""Messages of one atomic batch at most (nats-server allows 1,000)."""
BATCH_MIN = 24
"""Messages of one atomic batch at least: fewer go as single publishes, pipelined (publish_each). An atomic
batch costs nats-server 4-5 ms whatever its size, and one connection's batches wait for each other: one in
flight, 5.1 ms for a batch of 1 message and 6.8 ms for 20, against 0.85 ms for a publish and 1.3 ms for two
pipelined; in messages/s, batches of 2 make 420-560 at 1 to 32 in flight against 1,600-3,500 pipelined,
batches of 8 make 1,700-2,400 against 2,900-4,000, and batches of 32 make 5,300-7,100 against 3,000-4,300
(`.venv/bin/python bench/nats_probe.py`, "atomic batches")."""


def atomic(count: int) -> bool:
    """Whether `count` messages for one stream go as one atomic batch (BATCH_MIN to BATCH_MAX)."""
    return BATCH_MIN <= count <= BATCH_MAX


Message = tuple[str, bytes, dict[str, str]]
"""(subject, payload, headers)"""


@dataclass(eq=False)
class _Write:
    messages: list[Message]
    done: asyncio.Future[list[Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class SharedWrites:
    """The shared writes into one stream of one connection."""

    def __init__(self, stream: str, publish_batch: Callable[[list[Message]], Awaitable[list[int]]],
                 publish_each: Callable[[list[Message]], Awaitable[list[Any]]]):
        self.stream = stream
        self._publish_batch = publish_batch
        """JetStreamConnection.publish_batch: one atomic batch, its sequences, or an APIError raised."""
        self._publish_each = publish_each
        """JetStreamConnection.publish_each: pipelined, an answer each."""
        self._waiting: list[_Write] = []
        self._flushing = False
        self.flushes = 0
        """Flushes made (each a batch or a pipelined round)."""
        self.batches = 0
        """Of them, atomic batches JetStream stored."""

    async def publish(self, messages: list[Message]) -> list[Any]:
        """Write the messages in order: for each, its PubAck or the APIError JetStream answered (returned,
        as JetStreamConnection.publish_each does). A NATS failure (timeout, connection lost) is raised to
        every caller of the flush: some of its messages may be stored. More than BATCH_MAX go as several
        writes, one after the other."""
        return await self.answers(self.enqueue(messages))

    def enqueue(self, messages: list[Message]) -> list[_Write]:
        """Queue the messages now, behind every write queued before (publish without its wait: what
        `answers` then waits for)."""
        writes = [_Write(messages[start:start + BATCH_MAX]) for start in range(0, len(messages), BATCH_MAX)]
        self._waiting += writes
        if writes and not self._flushing:
            # at the loop's next turn: the writes of the callers that run in this one go with it (many sends
            # started at once queue theirs one after the other; a flush started with the first alone made
            # the others wait for a second one)
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._start)
        return writes

    @staticmethod
    async def answers(writes: list[_Write]) -> list[Any]:
        """The answers of queued writes, in order (see publish)."""
        answers: list[Any] = []
        for write in writes:
            answers += await asyncio.shield(write.done)
        return answers

    def _start(self) -> None:
        taken: list[_Write] = []
        count = 0
        while self._waiting and count + len(self._waiting[0].messages) <= BATCH_MAX:
            count += len(self._waiting[0].messages)
            taken.append(self._waiting.pop(0))
        self._flushing = True
        self.flushes += 1
        task = asyncio.ensure_future(self._flush([m for write in taken for m in write.messages]))
        task.add_done_callback(lambda done: self._ended(taken, done))

    def _ended(self, taken: list[_Write], done: asyncio.Future[list[Any]]) -> None:
        self._flushing = False
        failure = None if done.cancelled() else done.exception()
        start = 0
        for write in taken:
            answers = slice(start, start + len(write.messages))
            start = answers.stop  # (also past a write settled already: the next one's slice follows it)
            if write.done.done():
                continue
            if done.cancelled():  # the loop shutting down: its callers are too
                write.done.cancel()
            elif failure is not None:
                write.done.set_exception(failure)
                write.done.exception()  # retrieved: a caller that gave up does not leave it unseen
            else:
                write.done.set_result(done.result()[answers])
        if self._waiting:
            self._start()

    async def _flush(self, messages: list[Message]) -> list[Any]:
        if atomic(len(messages)):
            try:
                seqs = await self._publish_batch(messages)
                self.batches += 1
                return [PubAck(stream=self.stream, seq=seq) for seq in seqs]
            except APIError as exc:  # none stored: one at a time says which message JetStream refuses
                log.debug("atomic batch into %s refused (%s): one at a time", self.stream, exc)
        return await self._publish_each(messages)
