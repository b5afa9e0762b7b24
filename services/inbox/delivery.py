"""Streaming delivery: which messages go to which subscriber, when.

Each subscribed agent has a Feed on exactly one Subscription (a newer
Subscribe for the agent supersedes the older one). A feed delivers in inbox
order from its cursor, keeps at most `max_in_flight` delivered-but-unacked
messages outstanding, and gets its messages two ways:

- fast path: messages just appended are offered to the feed from memory
  (bounded; when the buffer overflows or shows a gap the feed falls back);
- store path: the feed reads from the store after its cursor. Always used
  on attach (this is how unacked messages are redelivered on reconnect),
  after a fallback, and as a safety net for a slice of the feeds each
  heartbeat.

Work is proportional to the feeds that have something to do: a feed that
gets work (an offer, a wake, an ack that makes room, its end) is put on its
subscription's ready queue, once, and the subscription visits only those,
in rounds, each feed taking at most `_ROUND_SHARE` messages per round; the
store reads of a round's feeds go at the same time (Subscription._take_all). A
feed with no room costs nothing until an ack. On a heartbeat the hub reads
the store once for closes made by other processes (InboxStore.closes_since)
and re-reads at most `SAFETY_SLICE` feeds, round robin.

Sequences are contiguous per inbox, so a feed can tell a gap from a
duplicate by comparing with its cursor.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator, Iterator

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import context_of, message_attributes, tracer
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.clock import now_us
from services.config import InboxLimits
from services.inbox.feed import DETACHED, Feed
from services.store.base import CloseOutcome, Store

log = logging.getLogger(__name__)
_MAX_DELIVERIES_BYTES = 1024 * 1024
_ROUND_SHARE = 32
"""Messages one feed takes per round: a feed with a long backlog goes to the back of the ready queue
after this many, so the other feeds of its stream are served in between."""
_ROUND_FEEDS = 256
"""Ready feeds visited per round before the round's deliveries are streamed."""
SAFETY_SLICE = 64
"""Feeds the hub re-reads from the store per heartbeat, round robin over all it serves (the safety net
for a wake that never came, such as an append by another process the store does not report)."""
CLOSE_PAGE = 512
"""Closes read per store call on a heartbeat."""
CLOSE_PAGES = 8
"""Store calls for closes per heartbeat at most; more closes wait for the next beat."""
_SHOWN_AGENTS = 8
"""Agent ids a log line or repr lists before it gives only the count."""
STORE_RETRY_S = (0.05, 2.0)
"""A subscription whose store read failed (the store unavailable) reads again after the first of these,
doubling up to the second, for as long as the failures last: the stream stays open meanwhile."""
_sub_ids = itertools.count(1)


def shown(agent_ids: list[str]) -> str:
    """Agent ids for a log line: the first few, then how many in all."""
    if len(agent_ids) <= _SHOWN_AGENTS:
        return ", ".join(agent_ids)
    return f"{', '.join(agent_ids[:_SHOWN_AGENTS])}, ... ({len(agent_ids)} agents)"


def _event(agent_id: str, kind: pb.SubscriptionEventKind, detail: str = "") -> pb.SubscribeResponse:
    return pb.SubscribeResponse(subscription=pb.SubscriptionEvent(agent_id=agent_id, kind=kind, detail=detail))


class Subscription:
    def __init__(self, hub: DeliveryHub, feeds: list[Feed], peer: str):
        self.id = next(_sub_ids)
        self.hub = hub
        self.peer = peer
        self.feeds = {feed.agent_id: feed for feed in feeds}
        """The feeds it delivers for (an ended one until its event is streamed)."""
        self.ready: collections.deque[Feed] = collections.deque()
        """Feeds with something to do, in the order they got it; bounded by the feeds (each once)."""
        self.finished: set[str] = set()
        """Agents whose feed it closed and streamed the end of while it owned them (DeliveryHub.release)."""
        self.wake = asyncio.Event()
        self.heartbeat_due = False
        self.stopped = False
        self.store_retry_s = 0.0
        """The wait before the next store read while the store fails (0: it does not)."""
        for feed in feeds:
            self.make_ready(feed)

    def make_ready(self, feed: Feed) -> None:
        """Queue the feed for a visit (once) and wake the stream, when a visit would do something."""
        if feed.has_work:
            if not feed.queued:
                feed.queued = True
                self.ready.append(feed)
            self.wake.set()

    def stop(self) -> None:
        """End responses() at its next step (the stream failed elsewhere).
        Not a cancel: a cancel that races an awaited request can be lost."""
        self.stopped = True
        self.wake.set()

    def __repr__(self) -> str:
        return f"Subscription#{self.id}({shown(list(self.feeds))})"

    async def responses(self) -> AsyncIterator[pb.SubscribeResponse]:
        hub = self.hub
        for feed in list(self.feeds.values()):
            if not feed.announced:
                feed.announced = True
                yield _event(feed.agent_id, pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
        await hub.following_closes()
        while self.feeds and not hub.closing and not self.stopped:
            self.wake.clear()
            visited: list[Feed] = []
            for _ in range(min(len(self.ready), _ROUND_FEEDS)):
                feed = self.ready.popleft()
                feed.queued = False
                if not feed.has_work:
                    continue  # detached, or it changed while queued (an ack it waited for was not enough)
                if not feed.announced:
                    feed.announced = True
                    yield _event(feed.agent_id, pb.SUBSCRIPTION_EVENT_KIND_ATTACHED)
                if feed.ended is not None:
                    kind, detail = feed.ended
                    feed.ended = (DETACHED, detail)  # streamed: never again
                    if self.feeds.get(feed.agent_id) is feed:  # not replaced by a newer attach
                        del self.feeds[feed.agent_id]
                        hub.finished(self, feed)
                    yield _event(feed.agent_id, kind, detail)
                    continue
                visited.append(feed)
            batch = self._taken(visited, await self._take_all(visited))
            if batch:
                for response in self._deliveries(batch):
                    yield response
            if self.store_retry_s:
                await self._rest()
                if self.heartbeat_due:
                    self.heartbeat_due = False
                    yield pb.SubscribeResponse(heartbeat=pb.Heartbeat(at_us=now_us()))
                continue
            if batch:
                continue
            if self.ready:
                continue
            if not self.feeds:
                break
            await self.wake.wait()
            if self.heartbeat_due:
                self.heartbeat_due = False
                yield pb.SubscribeResponse(heartbeat=pb.Heartbeat(at_us=now_us()))

    def _store_failed(self, feeds: list[Feed], exc: errors.Unavailable) -> None:
        """Store reads for these feeds (of one round) failed: the stream stays open (what it delivered stays
        in flight, and acks are still taken), and the feeds are read again after a wait that doubles while
        failures last. Ending the stream instead would have the host subscribe again and get every unacked
        message again, each time one more delivery attempt: a store that comes and goes would dead-letter
        them."""
        low, high = STORE_RETRY_S
        if not self.store_retry_s:
            log.warning("delivery on %r paused, reading again shortly: %s", self, exc.message)
        self.store_retry_s = min(high, max(low, 2 * self.store_retry_s))
        for feed in reversed(feeds):  # first in line when the wait is over, in their order
            feed.needs_store = True
            if not feed.queued:
                feed.queued = True
                self.ready.appendleft(feed)

    async def _rest(self) -> None:
        """Wait before reading the store again (cut short when the mesh shuts down or the stream stops)."""
        self.wake.clear()
        waits = [asyncio.ensure_future(self.hub.shut.wait()), asyncio.ensure_future(self.wake.wait())]
        try:
            await asyncio.wait(waits, timeout=self.store_retry_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _take_all(self, feeds: list[Feed]) -> list[list[envelope_pb2.Envelope] | BaseException]:
        """The shares of the round's feeds, taken at the same time: each feed's store reads and writes are
        round trips (on JetStream every take is one, and several), and the store shares those made at
        the same moment (one flush of the delivered events for all the feeds, one read of their agent
        records). Taken one feed after the other, a stream of many agents with a message each waited
        for every feed's round trips in turn. A feed that takes from memory (SQLite's fast path: its write
        is only queued) is taken in line, without a task of its own. What a take raised is in its place."""
        results: list[list[envelope_pb2.Envelope] | BaseException] = [[] for _ in feeds]
        reads = [i for i, feed in enumerate(feeds) if feed.needs_store and feed.room > 0]
        if len(reads) == 1:
            reads = []  # alone: in line too
        for i in sorted(set(range(len(feeds))) - set(reads)):
            try:
                results[i] = await self._take(feeds[i])
            except Exception as exc:
                results[i] = exc
        if reads:
            taken = await asyncio.gather(*(self._take(feeds[i]) for i in reads), return_exceptions=True)
            for i, result in zip(reads, taken):
                results[i] = result
        return results

    def _taken(self, feeds: list[Feed], results: list[list[envelope_pb2.Envelope] | BaseException]
               ) -> list[tuple[Feed, list[envelope_pb2.Envelope]]]:
        """The round's deliveries, feed by feed. A feed whose store read failed (the store unavailable) is
        read again after a wait, first in line; any other failure ends the stream."""
        for result in results:
            if isinstance(result, BaseException) and not (
                    isinstance(result, errors.Unavailable) and result.reason == Reason.STORE_UNAVAILABLE):
                raise result
        failed = [(feed, r) for feed, r in zip(feeds, results) if isinstance(r, errors.Unavailable)]
        if failed:
            self._store_failed([feed for feed, _ in failed], failed[0][1])
        if not failed and feeds and self.store_retry_s:
            log.info("delivery on %r: the store answers again", self)
            self.store_retry_s = 0.0
        batch: list[tuple[Feed, list[envelope_pb2.Envelope]]] = []
        for feed, result in zip(feeds, results):
            if isinstance(result, BaseException):
                continue
            if result:
                batch.append((feed, result))
            self.make_ready(feed)  # when it has more: its next share comes in a later round
        return batch

    async def _take(self, feed: Feed) -> list[envelope_pb2.Envelope]:
        """The feed's share of this round: from the store when it needs it, else from memory."""
        if feed.room <= 0:
            return []
        share = min(feed.room, _ROUND_SHARE)
        if feed.needs_store:
            return await self._read_store(feed, share)
        fresh = feed.take_fresh(now_us(), share)
        if fresh:
            try:
                await self.hub.store.mark_delivered(feed.agent_id, fresh, now_us())
            except errors.Unavailable:  # not delivered after all: the feed reads them from the store later
                feed.cursor = fresh[0].sequence - 1
                feed.in_flight.difference_update(e.sequence for e in fresh)
                feed.needs_store = True
                raise
        return fresh

    async def _read_store(self, feed: Feed, limit: int) -> list[envelope_pb2.Envelope]:
        woken, acked = feed.woken, feed.acked
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
            if feed.woken == woken and feed.acked == acked:  # no ack (nor append) came while reading
                feed.needs_store, feed.held_back = False, True
        elif (found.drained or len(found.messages) + len(found.dead_lettered) < limit) and feed.woken == woken:
            feed.needs_store = False
            while feed.fresh and feed.fresh[0].sequence <= feed.cursor:
                feed.fresh.popleft()
        return found.messages

    def _deliveries(self, batch: list[tuple[Feed, list[envelope_pb2.Envelope]]]) -> Iterator[pb.SubscribeResponse]:
        """The round's messages in chunks of at most _MAX_DELIVERIES_BYTES. A feed detached while an
        earlier chunk was written sends nothing more (its messages stay unacked in the store)."""
        envelopes = [e for _, taken in batch for e in taken]
        spans = [
            tracer.start_span("deliver", context=context_of(e), attributes=message_attributes(e)) for e in envelopes
        ]
        if log.isEnabledFor(logging.DEBUG):
            for e in envelopes:
                log.debug("delivering %s seq=%d from %s to %s (attempt %d) on %r",
                          e.message_id, e.sequence, e.sender, e.recipient, e.delivery_attempt, self)
        chunk: list[envelope_pb2.Envelope] = []
        size = 0
        for feed, taken in batch:
            if self.feeds.get(feed.agent_id) is not feed:
                continue
            for envelope in taken:
                envelope_size = envelope.ByteSize()
                if chunk and size + envelope_size > _MAX_DELIVERIES_BYTES:
                    yield pb.SubscribeResponse(deliveries=pb.Deliveries(messages=chunk))
                    chunk, size = [], 0
                chunk.append(envelope)
                size += envelope_size
        if chunk:
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
        self._owners: collections.OrderedDict[str, tuple[Subscription, Feed]] = collections.OrderedDict()
        """Each served agent's subscription and feed; the order is the safety net's round robin."""
        self._subscriptions: set[Subscription] = set()
        self._beats: asyncio.Task[None] | None = None
        self._close_cursor: int | None = None
        """Where the closes read on the last beat ended (InboxStore.closes_since); None until known."""
        self._cursor_known = asyncio.Event()
        """Set once the first cursor read is done (or failed): streams read their feeds only after it."""
        self.beats = 0
        """Heartbeats done (tests wait for them)."""

    # -- heartbeats -------------------------------------------------------------------
    def _start_beats(self) -> None:
        if self._beats is None and not self.closing:
            self._beats = asyncio.get_running_loop().create_task(self._beat_loop(), name="delivery-heartbeats")

    async def following_closes(self) -> None:
        """Return once the hub follows closes from a known cursor, so a close made after a feed's first
        store read is among those the next beats read."""
        await self._cursor_known.wait()

    async def _beat_loop(self) -> None:
        """One task for every subscription (rather than a timeout on every wait): establish the close
        cursor, then every heartbeat interval beat."""
        await self._read_cursor()
        while not self.closing:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                await self._beat()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the heartbeats of every stream
                log.exception("delivery heartbeat failed")

    async def _read_cursor(self) -> None:
        try:
            self._close_cursor = (await self.store.closes_since(None, CLOSE_PAGE)).cursor
        except errors.Unavailable as exc:  # the next beat tries again (and then re-reads every feed once)
            log.warning("closes made elsewhere not followed yet: %s", exc.message)
        except Exception:
            log.exception("closes made elsewhere not followed yet")
        finally:
            self._cursor_known.set()

    async def _beat(self) -> None:
        """Tell each open subscription to send a heartbeat; end the feeds of agents closed elsewhere (one
        bounded store read for the whole hub); re-read a slice of the feeds as the safety net."""
        self.beats += 1
        for subscription in self._subscriptions:
            subscription.heartbeat_due = True
            subscription.wake.set()
        self._sweep(SAFETY_SLICE)
        if self._close_cursor is None:
            await self._read_cursor()
            if self._close_cursor is not None:  # closes before it may have been missed: read every feed once
                self._sweep(len(self._owners))
            return
        for _ in range(CLOSE_PAGES):
            try:
                found = await self.store.closes_since(self._close_cursor, CLOSE_PAGE)
            except errors.Unavailable as exc:
                log.info("closes made elsewhere not read this beat: %s", exc.message)
                return
            self._close_cursor = found.cursor
            for agent_id, reason in found.closed:
                self._end(agent_id, pb.SUBSCRIPTION_EVENT_KIND_CLOSED, f"agent closed: {reason}")
            if not found.more:
                return

    def _sweep(self, count: int) -> None:
        """Make the next `count` feeds of the round robin read the store."""
        for agent_id in list(itertools.islice(self._owners, count)):
            subscription, feed = self._owners[agent_id]
            self._owners.move_to_end(agent_id)
            feed.needs_store = True
            subscription.make_ready(feed)

    # -- subscriptions ------------------------------------------------------------------
    def open(self, agent_ids: list[str], max_in_flight: int, peer: str) -> Subscription:
        self._start_beats()
        max_in_flight = self._capped(max_in_flight)
        subscription = Subscription(self, [Feed(a, max_in_flight) for a in agent_ids], peer)
        self._subscriptions.add(subscription)
        for agent_id in agent_ids:
            self._take_over(agent_id, subscription, subscription.feeds[agent_id])
        log.info("subscribed %s from %s", shown(agent_ids), peer)
        return subscription

    def attach(self, subscription: Subscription, agent_ids: list[str], max_in_flight: int) -> None:
        """Add feeds for these agents to an open subscription, superseding
        their other owners as open() does. Each new feed reads the store
        (redelivering what is unacked) and is announced by an ATTACHED event
        on the subscription's responses before any of its deliveries. An
        agent the subscription already delivers for keeps its feed and is
        announced ATTACHED again."""
        max_in_flight = self._capped(max_in_flight)
        added = []
        for agent_id in agent_ids:
            current = subscription.feeds.get(agent_id)
            if current is not None and current.ended is None:
                current.announced = False
                subscription.make_ready(current)
                continue
            # (a feed of this agent that ended here is still queued: its event streams before this ATTACHED)
            feed = Feed(agent_id, max_in_flight)
            subscription.feeds[agent_id] = feed
            self._take_over(agent_id, subscription, feed)
            subscription.make_ready(feed)
            added.append(agent_id)
        if added:
            log.info("attached %s to %r", shown(added), subscription)

    def detach(self, subscription: Subscription, agent_ids: list[str]) -> list[str]:
        """Remove these agents' feeds from the subscription; returns those it
        owned. A detached feed delivers nothing more (what it delivered and
        was not acked stays in flight in the store, redelivered on the next
        attach); no subscription event is sent for it. A subscription left
        with no feeds ends its responses()."""
        detached = []
        for agent_id in agent_ids:
            feed = subscription.feeds.get(agent_id)
            if feed is None or feed.ended is not None:
                # one that ended here (closed, superseded) keeps that end: its event still goes out and
                # finished() records it (a detach racing a close must not swallow the CLOSED)
                continue
            owner = self._owners.get(agent_id)
            if owner is not None and owner[0] is subscription:
                del self._owners[agent_id]
            del subscription.feeds[agent_id]
            detached.append(agent_id)
            feed.end(DETACHED, "detached")
        if detached:
            log.info("detached %s from %r", shown(detached), subscription)
            subscription.wake.set()
        return detached

    def _capped(self, max_in_flight: int) -> int:
        return min(max_in_flight or self.limits.max_in_flight, 10 * self.limits.max_in_flight)

    def _take_over(self, agent_id: str, subscription: Subscription, feed: Feed) -> None:
        """Make `feed` the agent's one feed, ending the one it had elsewhere."""
        previous = self._owners.pop(agent_id, None)
        if previous is not None and previous[1] is not feed:
            old_subscription, old_feed = previous
            old_feed.end(pb.SUBSCRIPTION_EVENT_KIND_SUPERSEDED,
                         f"taken over by a subscription from {subscription.peer}")
            old_subscription.make_ready(old_feed)
            if old_subscription is not subscription:
                log.info("agent %s: subscription from %s supersedes %r", agent_id, subscription.peer,
                         old_subscription)
        self._owners[agent_id] = (subscription, feed)

    def finished(self, subscription: Subscription, feed: Feed) -> None:
        """The subscription streamed the end of a feed it still owned (its agent closed): the hub lets
        go of the agent, and release() still counts it as the subscription's."""
        owner = self._owners.get(feed.agent_id)
        if owner is not None and owner[1] is feed:
            del self._owners[feed.agent_id]
            subscription.finished.add(feed.agent_id)

    def release(self, subscription: Subscription) -> list[str]:
        """Forget a finished subscription; returns the agents it still owned (and those it owned until
        they closed)."""
        self._subscriptions.discard(subscription)
        released = [a for a in subscription.finished if a not in subscription.feeds]
        subscription.finished.clear()
        for agent_id in subscription.feeds:
            owner = self._owners.get(agent_id)
            if owner is not None and owner[0] is subscription:
                del self._owners[agent_id]
                released.append(agent_id)
        return released

    # -- what happened to inboxes ---------------------------------------------------------
    def on_appended(self, envelopes: list[envelope_pb2.Envelope]) -> None:
        if not self.store.fresh_delivery:
            for envelope in envelopes:
                self.wake_agent(envelope.recipient)
            return
        for envelope in envelopes:
            owner = self._owners.get(envelope.recipient)
            if owner is not None and owner[1].offer(envelope):
                owner[0].make_ready(owner[1])

    def wake_agent(self, agent_id: str) -> None:
        """Something was appended to the agent's inbox (maybe by another
        process): its feed reads the store."""
        owner = self._owners.get(agent_id)
        if owner is not None:
            owner[1].needs_store = True
            owner[1].woken += 1
            owner[0].make_ready(owner[1])

    def on_acked(self, agent_id: str, sequences: list[int]) -> None:
        owner = self._owners.get(agent_id)
        if owner is not None:
            feed = owner[1]
            feed.in_flight.difference_update(sequences)
            feed.acked += 1  # a store read under way may have been held back for capacity: it must not settle
            if feed.held_back:
                feed.needs_store, feed.held_back = True, False
            owner[0].make_ready(feed)

    def on_closed(self, outcome: CloseOutcome) -> None:
        self.on_appended(outcome.notices)
        for record in outcome.closed:
            self._end(record.agent_id, pb.SUBSCRIPTION_EVENT_KIND_CLOSED, f"agent closed: {record.close_reason}")

    def _end(self, agent_id: str, kind: pb.SubscriptionEventKind, detail: str) -> None:
        owner = self._owners.get(agent_id)
        if owner is not None:
            owner[1].end(kind, detail)
            owner[0].make_ready(owner[1])

    def shutdown(self) -> None:
        self.closing = True
        self.shut.set()
        self._cursor_known.set()
        if self._beats is not None:
            self._beats.cancel()
            self._beats = None
        for subscription in self._subscriptions:
            subscription.wake.set()

    @staticmethod
    def subscription_events(kind: ev.EventKind, agent_ids: list[str], detail: str) -> list[ev.Event]:
        at = now_us()
        return [ev.Event(at_us=at, kind=kind, agent_id=a, detail=detail) for a in agent_ids]
