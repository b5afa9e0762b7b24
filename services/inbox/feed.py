"""One agent's delivery state on one subscription (services.inbox.delivery streams it)."""

from __future__ import annotations

import collections

from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2 as pb

DETACHED = pb.SUBSCRIPTION_EVENT_KIND_UNSPECIFIED
"""The end of a feed that streams no event (any more): detached (DeliveryHub.detach), or its end was
streamed."""


class Feed:
    """One agent's delivery state on one subscription."""

    __slots__ = ("agent_id", "max_in_flight", "cursor", "in_flight", "fresh", "fresh_limit", "needs_store", "ended",
                 "woken", "acked", "held_back", "queued", "announced")

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
        self.acked = 0
        """Counts acks of its messages: a read the store held back for capacity that raced one reads
        again (a read that was not held back is not changed by an ack)."""
        self.held_back = False
        """The store held messages back for the recipient's capacity: read again after an ack."""
        self.queued = False
        """On its subscription's ready queue (a feed is there at most once)."""
        self.announced = False
        """Its ATTACHED event was streamed."""

    @property
    def room(self) -> int:
        return self.max_in_flight - len(self.in_flight)

    @property
    def has_work(self) -> bool:
        """Whether a visit would do something: announce it, stream its end, or deliver (it has room and
        messages in memory or to read). A full feed has none until an ack."""
        if self.ended is not None:
            return self.ended[0] != DETACHED
        return not self.announced or (self.room > 0 and (self.needs_store or bool(self.fresh)))

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

    def take_fresh(self, now: int, limit: int) -> list[envelope_pb2.Envelope]:
        """Up to `limit` (and the room) buffered messages that follow the cursor."""
        taken: list[envelope_pb2.Envelope] = []
        room = min(self.room, limit)
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
