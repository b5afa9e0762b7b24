"""The inbox stream of the JetStream store (IM_INBOX, one subject per agent, `im.inbox.<agent_id>`):
publishing a message with its capacity and closed-target checks, reading an inbox in order, taking a
message back, deleting one whose state is final."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

from nats.js.errors import APIError, NotFoundError

from inboxmesh.common.v1 import envelope_pb2
from services.store.base import ACCEPTED, DUPLICATE, INBOX_FULL, TARGET_CLOSED, AgentRecord
from services.store.jetstream import kv
from services.store.jetstream.connection import IN_PROCESS, JetStreamConnection
from services.store.jetstream.kv import REJECTED, MessageState

log = logging.getLogger(__name__)
FULL_CODE = 10077
"""JetStream: maximum messages per subject exceeded."""


PURGE_MIN = 3
"""Final messages of one inbox at least that are removed by one purge (read + purge: two requests), not a
delete each."""


class Published(NamedTuple):
    status: int
    """ACCEPTED, DUPLICATE, INBOX_FULL or TARGET_CLOSED."""
    detail: str
    seq: int
    """The message's sequence (ACCEPTED, DUPLICATE), else 0."""
    settled: bool = True
    """False: published by publish_many, its capacity and the target's state not settled yet (settle)."""


_SettleCall = tuple[list[Published], int, "asyncio.Future[list[Published]]"]
"""A send's messages to settle, its target's capacity, and where its results go."""


class InboxMessages:
    def __init__(self, conn: JetStreamConnection, read_agent: Callable[[str], Awaitable[AgentRecord | None]]):
        self.conn = conn
        self._read_agent = read_agent
        """The agent's record as the bucket holds it now (AgentCache.fresh): the settle of a racing close."""
        self._to_settle: dict[str, list[_SettleCall]] = {}
        """Per recipient, the sends waiting for the next settle."""
        self._settling: set[str] = set()
        """Recipients with a settle in flight."""

    def subject(self, agent_id: str) -> str:
        return f"{self.conn.ns}.inbox.{kv.token(agent_id)}"

    async def next(self, recipient: str, seq: int, latest: bool = False) -> envelope_pb2.Envelope | None:
        """The first message of the inbox at or after `seq`, its sequence filled in. `latest`: as the stream's
        leader has it when there are replicas (a direct get may be answered by a follower behind it)."""
        try:
            msg = await self.conn.js.get_msg(self.conn.inbox_stream, seq=seq, subject=self.subject(recipient),
                                             next=True, direct=not latest or self.conn.config.nats_replicas == 1)
        except NotFoundError:
            return None
        return _envelope(msg)

    async def read(self, recipient: str, seq: int, batch: int) -> tuple[list[envelope_pb2.Envelope], int]:
        """The inbox's first `batch` messages at or after `seq`, in order (one batched direct get), and
        how many more follow them."""
        found, more = await self.conn.direct_batch(self.conn.inbox_stream, self.subject(recipient), seq, batch)
        envelopes = []
        for msg in found:
            envelope = envelope_pb2.Envelope.FromString(msg.data)
            envelope.sequence = int(msg.headers["Nats-Sequence"])
            envelopes.append(envelope)
        if self.conn.config.nats_replicas > 1 and len(envelopes) < batch:
            # Any replica answers a direct get, and one a while behind its leader (restarted, catching up)
            # answers from what it has: the leader says what the subject holds, and what that replica did
            # not have is read from the leader.
            reached = envelopes[-1].sequence if envelopes else seq - 1
            last = await self._last_on_leader(recipient)
            while last > reached and len(envelopes) < batch:
                try:
                    msg = await self.conn.js.get_msg(self.conn.inbox_stream, seq=reached + 1,
                                                     subject=self.subject(recipient), next=True)
                except NotFoundError:
                    break
                envelopes.append(_envelope(msg))
                reached = msg.seq
            more = max(more, int(last > reached))
        return envelopes, more

    async def _last_on_leader(self, recipient: str) -> int:
        """The sequence of the last message on the recipient's subject, as the stream's leader has it (0:
        none)."""
        try:
            msg = await self.conn.js.get_msg(self.conn.inbox_stream, subject=self.subject(recipient))
        except NotFoundError:
            return 0
        return int(msg.seq)

    async def envelope_at(self, recipient: str, seq: int, latest: bool = False) -> envelope_pb2.Envelope | None:
        env = await self.next(recipient, seq, latest)
        return env if env is not None and env.sequence == seq else None

    async def delete(self, seq: int) -> None:
        """Remove a final message from the stream (frees its inbox's capacity).
        `no_erase`: the default overwrites the bytes on disk first, which
        costs nats-server about 5 times the CPU (0.7 ms against 0.15 ms), and
        the message's state entry keeps the envelope anyway."""
        await self.conn.nc.request(f"$JS.API.STREAM.MSG.DELETE.{self.conn.inbox_stream}",
                                   json.dumps({"seq": seq, "no_erase": True}).encode(),
                                   timeout=self.conn.config.nats_timeout_s)
        # an error answer (already gone) needs nothing more

    async def delete_many(self, final: dict[str, list[int]]) -> None:
        """Remove final messages from the stream at once: per recipient, the sequences of its final messages.
        Where they are the front of the recipient's inbox (an ack of what was delivered in order, the usual
        case), one purge of its subject below the last of them (purge_front); the others pipelined, one
        request each, as `delete`."""
        fronts = [(recipient, sequences) for recipient, sequences in final.items() if len(sequences) >= PURGE_MIN
                  and self.conn.config.nats_replicas == 1]
        purged = await asyncio.gather(*(self.purge_front(recipient, sequences) for recipient, sequences in fronts))
        done = {recipient for (recipient, _), was in zip(fronts, purged) if was}
        rest = [seq for recipient, sequences in final.items() if recipient not in done for seq in sequences]
        if rest:
            subject = f"$JS.API.STREAM.MSG.DELETE.{self.conn.inbox_stream}"
            await self.conn.request_many([(subject, json.dumps({"seq": seq, "no_erase": True}).encode(), None)
                                          for seq in rest])

    async def purge_front(self, recipient: str, sequences: list[int]) -> bool:
        """Remove the final messages `sequences` of the recipient's inbox in one purge of its subject below
        the last of them, when no other message lies below it (one read of the first messages says; a
        message stored later has a higher sequence than any of them); False, nothing removed, when one
        does. Only with one replica: a direct get may be answered by a follower behind its leader, which
        would not show a message below them that the leader holds."""
        last = max(sequences)
        found, _ = await self.conn.direct_batch(self.conn.inbox_stream, self.subject(recipient), 1, len(sequences))
        final = set(sequences)
        if any(int(msg.headers["Nats-Sequence"]) not in final for msg in found
               if int(msg.headers["Nats-Sequence"]) <= last):
            return False
        answer, = await self.conn.request_many([(f"$JS.API.STREAM.PURGE.{self.conn.inbox_stream}",
                                                 json.dumps({"filter": self.subject(recipient),
                                                             "seq": last + 1}).encode(), None)])
        reply = json.loads(answer.data) if answer.data else {}
        if "error" in reply:
            log.debug("purge of %s's final messages refused (%s): one at a time", recipient, reply["error"])
            return False
        return True

    async def unconsumed(self, recipient: str) -> int:
        """How many messages the recipient's inbox holds now (the capacity count). With one replica, one
        batched direct get of the inbox's first message, which says how many follow it: the stream answers
        it itself, in half the time and client CPU of the JetStream API's stream info that counted before
        (a settle of 64 recipients at once 6.5-8.5 against 16-17 ms here; the many-agent benchmark makes a
        count for nearly every message). With more replicas a follower may answer a direct get a moment
        behind its leader and count short, so the leader counts, through the stream info."""
        subject = self.subject(recipient)
        if self.conn.config.nats_replicas == 1:
            first, following = await self.conn.direct_batch(self.conn.inbox_stream, subject, 1, 1)
            return len(first) + following
        info = await self.conn.js.stream_info(self.conn.inbox_stream, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))

    async def publish(self, recipient: str, envelope: envelope_pb2.Envelope, capacity: int, *,
                      tell: bool = True) -> Published:
        """Put the envelope on the recipient's subject, then settle its capacity and a close that raced it.
        tell: notify the other processes now (told); False: the caller does once its events are recorded."""
        msg_id = kv.msg_id_header(envelope.sender, envelope.message_id)
        while True:
            try:
                ack = await self.conn.js.publish(self.subject(recipient), envelope.SerializeToString(),
                                                 headers={"Nats-Msg-Id": msg_id})
            except APIError as exc:
                if exc.err_code == FULL_CODE:
                    return Published(INBOX_FULL, _full(recipient, capacity, capacity), 0)
                raise
            if not ack.duplicate:
                if tell:
                    await self.told(recipient)
                break
            earlier = await kv.get(self.conn.msgs, kv.state_key(recipient, ack.seq), kv.MESSAGE_STATE)
            if earlier is None or earlier.value.state != REJECTED:
                return Published(DUPLICATE, "already accepted from this sender; nothing stored again", ack.seq)
            # JetStream remembers an attempt that was refused after all: a retry is a new attempt
            msg_id = f"{kv.msg_id_header(envelope.sender, envelope.message_id)}#{ack.seq}"
        if capacity < self.conn.config.max_inbox_capacity:
            held = await self.unconsumed(recipient)
            if held > capacity and await self.reject(recipient, ack.seq):
                return Published(INBOX_FULL, _full(recipient, held - 1, capacity), 0)
        now_open = await self._read_agent(recipient)
        if now_open is not None and not now_open.is_open and await self.reject(recipient, ack.seq):
            return Published(TARGET_CLOSED, f"agent {recipient} is closed", 0)
        return Published(ACCEPTED, "", ack.seq)

    async def publish_many(self, recipient: str, envelopes: list[envelope_pb2.Envelope],
                           capacity: int) -> list[Published]:
        """Put the envelopes on the recipient's subject in their order, pipelined (one connection keeps
        the order of what it publishes). An envelope JetStream takes for a duplicate is settled on its
        own, as `publish` does; the others still need `settle`. The other processes are not told: the
        append does, once its events are recorded (InboxLog.append_many)."""
        subject = self.subject(recipient)
        messages = [(subject, env.SerializeToString(), {"Nats-Msg-Id": kv.msg_id_header(env.sender, env.message_id)})
                    for env in envelopes]
        # with the messages other sends publish at the same time, as an atomic batch when there are many
        # (shared_writes.py: a retry among them, an inbox at its limit, and they go one at a time)
        acks = await self.conn.inbox_writes.publish(messages)
        found: list[Published] = []
        for env, ack in zip(envelopes, acks):
            if isinstance(ack, APIError) and ack.err_code == FULL_CODE:
                found.append(Published(INBOX_FULL, _full(recipient, capacity, capacity), 0))
            elif isinstance(ack, APIError) and ack.err_code == IN_PROCESS:  # being stored right now (a retry)
                found.append(await self.publish(recipient, env, capacity))  # settled as a duplicate is
            elif isinstance(ack, BaseException):
                raise ack  # NATS failed: some may be stored; the client retries them by id
            elif ack.duplicate:
                found.append(await self.publish(recipient, env, capacity, tell=False))
            else:
                found.append(Published(ACCEPTED, "", ack.seq, settled=False))
        return found

    async def told(self, recipient: str, recorded: Iterable[int] = ()) -> None:
        """Tell the other mesh processes that the recipient's inbox has new messages, stored now: a core
        NATS notice (appended_subject). This process's own delivery hub is woken by the append itself, and
        its connection does not get its own notices back (`no_echo`). (The stream's own publishes are no
        such notice: those of an atomic batch reach a subscriber before the batch is stored.)
        `recorded`: the sequences among them whose sent and stored events are recorded already (the
        append tells once it recorded them): their first delivery elsewhere publishes no copies of them."""
        await self.conn.nc.publish(self.conn.appended_subject(kv.token(recipient)),
                                   ",".join(map(str, recorded)).encode())

    async def settle(self, recipient: str, published: list[Published], capacity: int) -> list[Published]:
        """Settle capacity and a close that raced the messages publish_many put on the subject, once for
        all: over capacity, the newest of them are taken back, so what stays is the front of the run
        (FIFO); the target closed meanwhile, all of them (but those a close dead-lettered already).

        Sends to one recipient at about the same time are settled together (one read of the target and
        of its count for all of them, as AgentCache.fresh shares reads): at most one settle per
        recipient is in flight, and the sends that come while it is wait for the next, which starts
        when it ends, so each is settled by reads made after it published. Over capacity, the newest of
        all of them by sequence are taken back: each pair's accepted messages stay a front."""
        if all(p.settled for p in published):
            return [p._replace(settled=True) for p in published]
        waiting: asyncio.Future[list[Published]] = asyncio.get_running_loop().create_future()
        self._to_settle.setdefault(recipient, []).append((published, capacity, waiting))
        if recipient not in self._settling:
            self._start_settle(recipient)
        return await asyncio.shield(waiting)

    def _start_settle(self, recipient: str) -> None:
        calls = self._to_settle.pop(recipient)
        self._settling.add(recipient)
        task = asyncio.ensure_future(self._settle_together(recipient, calls))

        def ended(done: asyncio.Future[None]) -> None:
            self._settling.discard(recipient)
            failure = None if done.cancelled() else done.exception()
            for *_, waiting in calls:
                if waiting.done():
                    continue
                if failure is None:  # cancelled (the loop shutting down): its callers are too
                    waiting.cancel()
                else:
                    waiting.set_exception(failure)
                    waiting.exception()  # retrieved: a caller that gave up does not leave it unseen
            if recipient in self._to_settle:
                self._start_settle(recipient)

        task.add_done_callback(ended)

    async def _settle_together(self, recipient: str, calls: list[_SettleCall]) -> None:
        found = [[p._replace(settled=True) for p in published] for published, _, _ in calls]
        fresh = sorted(((c, i) for c, (published, _, _) in enumerate(calls)
                        for i, p in enumerate(published) if not p.settled), key=lambda at: found[at[0]][at[1]].seq)
        capacity = min(capacity for _, capacity, _ in calls)
        limited = capacity < self.conn.config.max_inbox_capacity
        now_open, held = await asyncio.gather(self._read_agent(recipient),
                                              self.unconsumed(recipient) if limited else _nothing())
        if now_open is not None and not now_open.is_open:
            taken = await asyncio.gather(*(self.reject(recipient, found[c][i].seq) for c, i in fresh))
            for (c, i), back in zip(fresh, taken):
                if back:
                    found[c][i] = Published(TARGET_CLOSED, f"agent {recipient} is closed", 0)
        elif held > capacity:
            for c, i in reversed(fresh[-(held - capacity):]):
                if not await self.reject(recipient, found[c][i].seq):
                    break  # a close dead-lettered it: it stays accepted, and so do the ones before it
                held -= 1
                found[c][i] = Published(INBOX_FULL, _full(recipient, held, capacity), 0)
        for (_, _, waiting), results in zip(calls, found):
            if not waiting.done():
                waiting.set_result(results)

    async def reject(self, recipient: str, seq: int) -> bool:
        """Take a just-published message back; False when a close already
        dead-lettered it (then it stays accepted)."""
        if await kv.create(self.conn.msgs, kv.state_key(recipient, seq), MessageState(REJECTED), kv.MESSAGE_STATE):
            await self.delete(seq)
            return True
        return False


async def _nothing() -> int:
    return 0


def _envelope(msg: Any) -> envelope_pb2.Envelope:
    envelope = envelope_pb2.Envelope.FromString(msg.data)
    envelope.sequence = msg.seq
    return envelope


def _full(recipient: str, held: int, capacity: int) -> str:
    return (f"agent {recipient} holds {held} unconsumed messages (capacity {capacity}); nothing was evicted,"
            " retry after it consumes")
