"""Streaming delivery: which messages go to which subscriber, when.

Each subscribed agent has a Feed on exactly one Subscription (a newer
Subscribe for the agent supersedes the older one). A feed delivers in inbox
order from its cursor, keeps at most `max_in_flight` delivered-but-unacked
messages outstanding, and gets its messages two ways:

- fast path: messages just appended are offered to the feed from memory
  (bounded; when the buffer overflows or shows a gap the feed falls back);
- store path: the feed reads from the store after its cursor. Always used
  on attach (this is how unacked messages are redelivered on reconnect),
  after a fallback, and every heartbeat as a safety net.

Sequences are contiguous per inbox, so a feed can tell a gap from a
duplicate by comparing with its cursor.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator

from inboxmesh.client.tracing import context_of, message_attributes, tracer
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.clock import now_us
from services.config import InboxLimits
from services.store.base import CloseOutcome, Store

log = logging.getLogger(__name__)
_MAX_DELIVERIES_BYTES = 1024 * 1024
_sub_ids = itertools.count(1)


class Feed:
    """One agent's delivery state on one subscription."""

    __slots__ = ("agent_id", "max_in_flight", "cursor", "in_flight", "fresh", "fresh_limit", "needs_store", "ended",
                 "woken", "held_back")

    def __init__(self, agent_id: str, max_in_flight: int):
        self.agent_id = agent_id
        self.max_in_flight = max_in_flight
        self.cursor = 0
        self.in_flight: set[int] = set()
        self.fresh: collections.deque[envelope_pb2.Envelope] = collections.deque()
        self.fresh_limit = max(64, 2 * max_in_flight)
        self.needs_store = True
        self.ended: tuple[pb.SubscriptionEventKind, str] | None = None
        self.woken = 0
        """Counts wake-ups for appends the feed must read from the store; a
        read that raced one does not clear needs_store."""
        self.held_back = False
        """The store held messages back for the recipient's capacity: read again after an ack."""

    @property
    def room(self) -> int:
        return self.max_in_flight - len(self.in_flight)

    def offer(self, envelope: envelope_pb2.Envelope) -> bool:
        """Take a just-appended message; True when the feed has new work."""
        if envelope.sequence <= self.cursor or self.ended:
            return False
        # Buffer even while a store read is pending: the read may have taken
        # its snapshot before this message committed.
        if len(self.fresh) >= self.fresh_limit:
            self.fresh.clear()
            self.needs_store = True
            return True
        self.fresh.append(envelope)
        return True

    def take_fresh(self, now: int) -> list[envelope_pb2.Envelope]:
        taken: list[envelope_pb2.Envelope] = []
        room = self.room
        while self.fresh and len(taken) < room:
            envelope = self.fresh[0]
            if envelope.sequence <= self.cursor:
                self.fresh.popleft()
                continue
            if envelope.sequence != self.cursor + 1 or (envelope.expires_at_us and envelope.expires_at_us <= now):
                self.needs_store = True  # a gap, or expiry for the store to handle
                break
            self.fresh.popleft()
            envelope.delivery_attempt = 1
            self.cursor = envelope.sequence
            self.in_flight.add(envelope.sequence)
            taken.append(envelope)
        return taken

    def end(self, kind: pb.SubscriptionEventKind, detail: str) -> None:
        if self.ended is None:
            self.ended = (kind, detail)
            self.fresh.clear()


class Subscription:
    def __init__(self, hub: DeliveryHub, feeds: list[Feed], peer: str):
        self.id = next(_sub_ids)
        self.hub = hub
        self.peer = peer
        self.feeds = {feed.agent_id: feed for feed in feeds}
        self.wake = asyncio.Event()
        self.heartbeat_due = False
        self.stopped = False
        self.attached: collections.deque[str] = collections.deque()
        """Agents attached after open (DeliveryHub.attach) whose ATTACHED event is still to be sent."""

    def stop(self) -> None:
        """End responses() at its next step (the stream failed elsewhere).
        Not a cancel: a cancel that races an awaited request can be lost."""
        self.stopped = True
        self.wake.set()

    def __repr__(self) -> str:
        return f"Subscription#{self.id}({', '.join(self.feeds)})"

    async def responses(self) -> AsyncIterator[pb.SubscribeResponse]:
        hub = self.hub
        for agent_id in self.feeds:
            yield pb.SubscribeResponse(
                subscription=pb.SubscriptionEvent(agent_id=agent_id, kind=pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
            )
        while self.feeds and not hub.closing and not self.stopped:
            self.wake.clear()
            while self.attached:
                agent_id = self.attached.popleft()
                if agent_id in self.feeds:
                    yield pb.SubscribeResponse(
                        subscription=pb.SubscriptionEvent(agent_id=agent_id, kind=pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
                    )
            batch: list[envelope_pb2.Envelope] = []
            for feed in list(self.feeds.values()):
                if self.feeds.get(feed.agent_id) is not feed:
                    continue  # detached (or replaced) while this pass awaited the store
                if feed.ended is not None:
                    del self.feeds[feed.agent_id]
                    kind, detail = feed.ended
                    yield pb.SubscribeResponse(
                        subscription=pb.SubscriptionEvent(agent_id=feed.agent_id, kind=kind, detail=detail)
                    )
                    continue
                if feed.room <= 0:
                    continue
                if feed.needs_store:
                    batch += await self._read_store(feed)
                else:
                    fresh = feed.take_fresh(now_us())
                    if fresh:
                        await hub.store.mark_delivered(feed.agent_id, fresh, now_us())
                        batch += fresh
            if batch:
                for response in self._deliveries(batch):
                    yield response
                continue
            if not self.feeds or any(f.ended or (f.needs_store and f.room > 0) for f in self.feeds.values()):
                continue
            await self.wake.wait()
            if self.heartbeat_due:
                self.heartbeat_due = False
                yield pb.SubscribeResponse(heartbeat=pb.Heartbeat(at_us=now_us()))
                for feed in self.feeds.values():
                    feed.needs_store = True  # safety net: re-read (also notices closes by other processes)

    async def _read_store(self, feed: Feed) -> list[envelope_pb2.Envelope]:
        limit = feed.room
        woken = feed.woken
        found = await self.hub.store.next_deliveries(
            feed.agent_id, feed.cursor, limit, self.hub.limits.max_delivery_attempts, now_us(),
            in_flight=len(feed.in_flight))
        if not found.recipient_open:
            feed.end(pb.SUBSCRIPTION_EVENT_KIND_CLOSED, f"agent closed: {found.close_reason}")
            return []
        if found.notices:
            self.hub.on_appended(found.notices)
        for record in found.dead_lettered:
            feed.cursor = max(feed.cursor, record.envelope.sequence)
            log.info(
                "dead-lettered message %s from %s in %s's inbox: %s",
                record.envelope.message_id, record.envelope.sender, feed.agent_id, record.dead_reason,
            )
        for envelope in found.messages:
            feed.cursor = max(feed.cursor, envelope.sequence)
            feed.in_flight.add(envelope.sequence)
        if found.held_back:  # nothing more until an ack makes room (reading again now would find the same)
            if feed.woken == woken:  # no ack (nor append) came while reading
                feed.needs_store, feed.held_back = False, True
        elif len(found.messages) + len(found.dead_lettered) < limit and feed.woken == woken:
            feed.needs_store = False
            while feed.fresh and feed.fresh[0].sequence <= feed.cursor:
                feed.fresh.popleft()
        return found.messages

    def _deliveries(self, batch: list[envelope_pb2.Envelope]):
        spans = [
            tracer.start_span("deliver", context=context_of(e), attributes=message_attributes(e)) for e in batch
        ]
        if log.isEnabledFor(logging.DEBUG):
            for e in batch:
                log.debug("delivering %s seq=%d from %s to %s (attempt %d) on %r",
                          e.message_id, e.sequence, e.sender, e.recipient, e.delivery_attempt, self)
        chunk: list[envelope_pb2.Envelope] = []
        size = 0
        for envelope in batch:
            envelope_size = envelope.ByteSize()
            if chunk and size + envelope_size > _MAX_DELIVERIES_BYTES:
                yield pb.SubscribeResponse(deliveries=pb.Deliveries(messages=chunk))
                chunk, size = [], 0
            chunk.append(envelope)
            size += envelope_size
        yield pb.SubscribeResponse(deliveries=pb.Deliveries(messages=chunk))
        for span in spans:
            span.end()


class DeliveryHub:
    """Routes appended messages, acks and closes to the owning feeds."""

    def __init__(self, store: Store, limits: InboxLimits, heartbeat_interval_s: float):
        self.store = store
        self.limits = limits
        self.heartbeat_interval_s = heartbeat_interval_s
        self.closing = False
        self.shut = asyncio.Event()
        """Set with `closing`: for streams that wait on something other than their feeds."""
        self._owners: dict[str, tuple[Subscription, Feed]] = {}
        self._heartbeat: asyncio.TimerHandle | None = None

    def _beat(self) -> None:
        """Every heartbeat interval: tell each open subscription to send a
        heartbeat and re-read its feeds (one timer for all of them, rather
        than a timeout on every wait)."""
        for subscription in {s for s, _ in self._owners.values()}:
            subscription.heartbeat_due = True
            subscription.wake.set()
        self._heartbeat = asyncio.get_running_loop().call_later(self.heartbeat_interval_s, self._beat)

    def open(self, agent_ids: list[str], max_in_flight: int, peer: str) -> Subscription:
        if self._heartbeat is None and not self.closing:
            self._heartbeat = asyncio.get_running_loop().call_later(self.heartbeat_interval_s, self._beat)
        max_in_flight = self._capped(max_in_flight)
        subscription = Subscription(self, [Feed(a, max_in_flight) for a in agent_ids], peer)
        for agent_id in agent_ids:
            self._take_over(agent_id, subscription, subscription.feeds[agent_id])
        log.info("subscribed %s from %s", ", ".join(agent_ids), peer)
        return subscription

    def _capped(self, max_in_flight: int) -> int:
        return min(max_in_flight or self.limits.max_in_flight, 10 * self.limits.max_in_flight)

    def _take_over(self, agent_id: str, subscription: Subscription, feed: Feed) -> None:
        """Make `feed` the agent's one feed, ending the one it had elsewhere."""
        previous = self._owners.get(agent_id)
        if previous is not None and previous[1] is not feed:
            old_subscription, old_feed = previous
            old_feed.end(pb.SUBSCRIPTION_EVENT_KIND_SUPERSEDED,
                         f"taken over by a subscription from {subscription.peer}")
            old_subscription.wake.set()
            log.info("agent %s: subscription from %s supersedes %r", agent_id, subscription.peer, old_subscription)
        self._owners[agent_id] = (subscription, feed)

    def attach(self, subscription: Subscription, agent_ids: list[str], max_in_flight: int) -> None:
        """Add feeds for these agents to an open subscription, superseding
        their other owners as open() does. Each new feed reads the store
        (redelivering what is unacked) and is announced by an ATTACHED event
        on the subscription's responses before any of its deliveries. An
        agent the subscription already delivers for keeps its feed."""
        max_in_flight = self._capped(max_in_flight)
        added = []
        for agent_id in agent_ids:
            current = subscription.feeds.get(agent_id)
            if current is not None and current.ended is None:
                continue
            feed = Feed(agent_id, max_in_flight)
            subscription.feeds[agent_id] = feed
            self._take_over(agent_id, subscription, feed)
            subscription.attached.append(agent_id)
            added.append(agent_id)
        if added:
            log.info("attached %s to %r", ", ".join(added), subscription)
            subscription.wake.set()

    def detach(self, subscription: Subscription, agent_ids: list[str]) -> list[str]:
        """Remove these agents' feeds from the subscription; returns those it
        owned. A detached feed delivers nothing more (what it delivered and
        was not acked stays in flight in the store, redelivered on the next
        attach); no subscription event is sent for it. A subscription left
        with no feeds ends its responses()."""
        detached = []
        for agent_id in agent_ids:
            feed = subscription.feeds.get(agent_id)
            if feed is None:
                continue
            owner = self._owners.get(agent_id)
            if owner is not None and owner[0] is subscription:
                del self._owners[agent_id]
            del subscription.feeds[agent_id]
            if feed.ended is None:
                feed.end(pb.SUBSCRIPTION_EVENT_KIND_UNSPECIFIED, "detached")
                detached.append(agent_id)
        if detached:
            log.info("detached %s from %r", ", ".join(detached), subscription)
            subscription.wake.set()
        return detached

    def release(self, subscription: Subscription) -> list[str]:
        """Forget a finished subscription; returns the agents it still owned."""
        released = []
        for agent_id in list(subscription.feeds) + [a for a, (s, _) in self._owners.items() if s is subscription]:
            owner = self._owners.get(agent_id)
            if owner is not None and owner[0] is subscription:
                del self._owners[agent_id]
                released.append(agent_id)
        return released

    def on_appended(self, envelopes: list[envelope_pb2.Envelope]) -> None:
        if not self.store.fresh_delivery:
            for envelope in envelopes:
                self.wake_agent(envelope.recipient)
            return
        for envelope in envelopes:
            owner = self._owners.get(envelope.recipient)
            if owner is not None and owner[1].offer(envelope):
                owner[0].wake.set()

    def wake_agent(self, agent_id: str) -> None:
        """Something was appended to the agent's inbox (maybe by another
        process): its feed reads the store."""
        owner = self._owners.get(agent_id)
        if owner is not None:
            owner[1].needs_store = True
            owner[1].woken += 1
            owner[0].wake.set()

    def on_acked(self, agent_id: str, sequences: list[int]) -> None:
        owner = self._owners.get(agent_id)
        if owner is not None:
            feed = owner[1]
            feed.in_flight.difference_update(sequences)
            feed.woken += 1  # a store read under way may have been held back for capacity: it must not settle
            if feed.held_back:
                feed.needs_store, feed.held_back = True, False
            owner[0].wake.set()

    def on_closed(self, outcome: CloseOutcome) -> None:
        self.on_appended(outcome.notices)
        for record in outcome.closed:
            owner = self._owners.get(record.agent_id)
            if owner is not None:
                owner[1].end(pb.SUBSCRIPTION_EVENT_KIND_CLOSED, f"agent closed: {record.close_reason}")
                owner[0].wake.set()

    def shutdown(self) -> None:
        self.closing = True
        self.shut.set()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for subscription, _ in list(self._owners.values()):
            subscription.wake.set()

    @staticmethod
    def subscription_events(kind: ev.EventKind, agent_ids: list[str], detail: str) -> list[ev.Event]:
        at = now_us()
        return [ev.Event(at_us=at, kind=kind, agent_id=a, detail=detail) for a in agent_ids]

