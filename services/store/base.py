"""The store interface the services use, and the records it speaks.

Shaped so that an append-only log with per-subject sequences (NATS
JetStream) can implement it as well as SQLite:

- every inbox has its own sequence, assigned at append, starting at 1;
- (sender, message_id) is the idempotency key;
- consumption is an explicit ack of a sequence, and exactly one ack wins;
- dead letters keep the message and the reason.

Everything that must be atomic with respect to concurrent calls (duplicate
detection, capacity, "is the recipient still open", ack winning once, close
dead-lettering what is queued) happens inside the store. Checks on facts
that never change after registration (scope, existence) happen in the
services against cached records.

Message envelopes are `inboxmesh.common.v1.Envelope` protobufs: they are the
wire contract, so the store keeps them as they travel.
"""

from __future__ import annotations

import abc
import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import cast

from inboxmesh.client.addressing import (  # re-exported: the store's users name them here
    A2A_PREFIX as A2A_PREFIX,
)
from inboxmesh.client.addressing import (
    CHANNEL_PREFIX as CHANNEL_PREFIX,
)
from inboxmesh.client.addressing import (
    EXTERNAL_PREFIXES as EXTERNAL_PREFIXES,
)
from inboxmesh.client.addressing import (
    IOA_PREFIX as IOA_PREFIX,
)
from inboxmesh.client.addressing import (
    RESERVED_ID_PREFIX as RESERVED_ID_PREFIX,
)
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.registry.v1 import registry_pb2
from inboxmesh.runs.v1 import runs_pb2

AGENT_OPEN = registry_pb2.AGENT_STATE_OPEN
AGENT_CLOSED = registry_pb2.AGENT_STATE_CLOSED

QUEUED = inbox_pb2.MESSAGE_STATE_QUEUED
DELIVERED = inbox_pb2.MESSAGE_STATE_DELIVERED
CONSUMED = inbox_pb2.MESSAGE_STATE_CONSUMED
DEAD_LETTERED = inbox_pb2.MESSAGE_STATE_DEAD_LETTERED

ACCEPTED = inbox_pb2.RECEIPT_STATUS_ACCEPTED
DUPLICATE = inbox_pb2.RECEIPT_STATUS_DUPLICATE
UNKNOWN_TARGET = inbox_pb2.RECEIPT_STATUS_UNKNOWN_TARGET
TARGET_CLOSED = inbox_pb2.RECEIPT_STATUS_TARGET_CLOSED
NOT_PERMITTED = inbox_pb2.RECEIPT_STATUS_NOT_PERMITTED
INBOX_FULL = inbox_pb2.RECEIPT_STATUS_INBOX_FULL
OUTBOXED = inbox_pb2.RECEIPT_STATUS_OUTBOXED

REASON_CLOSED = "recipient closed"
REASON_ATTEMPTS = "too many delivery attempts"
REASON_EXPIRED = "expired"


@dataclass(frozen=True)
class AgentRecord:
    agent_id: str
    name: str
    mode: int
    parent_id: str
    scope_id: str
    depth: int
    state: int
    metadata: dict[str, str]
    inbox_capacity: int
    created_at_us: int
    credential_hash: bytes = field(repr=False)
    closed_at_us: int = 0
    close_reason: str = ""

    @property
    def is_open(self) -> bool:
        return self.state == AGENT_OPEN


@dataclass(frozen=True)
class AppendItem:
    """One message of a send. `rejection` is set when the service already
    refused it (unknown target, not permitted): the store only records the
    attempt so that every outcome shows in the event record."""

    envelope: envelope_pb2.Envelope
    rejection: tuple[int, str] | None = None
    conversation_budget: int = 0
    """Most messages its conversation may hold (loop guard); 0 = no limit."""
    taken_at: float = math.inf
    """When the mesh took the send's request (time.monotonic()): a store that checks the sender is open
    with a read may take one begun since then (the JetStream store's, made beside the sender's frontier).
    inf: only a read begun once the store is asked."""


@dataclass(frozen=True)
class SendOutcome:
    message_id: str
    recipient: str
    status: int
    sequence: int = 0
    stored_at_us: int = 0
    detail: str = ""
    envelope: envelope_pb2.Envelope | None = None
    """The stored envelope (sequence filled) when status is ACCEPTED."""


@dataclass(frozen=True)
class AckOutcome:
    sequence: int
    message_id: str
    status: int
    traceparent: str = ""
    envelope: envelope_pb2.Envelope | None = None
    """The consumed envelope when this ack consumed it (status CONSUMED)."""


@dataclass(frozen=True)
class Frontier:
    """Where an agent stands in a causal chain (loop guard): the hop count and trail of the message it
    consumed most recently (the longest chain among those of one ack). What it sends next continues it."""

    hop_count: int
    trail: tuple[str, ...]

    @staticmethod
    def of(envelopes: Iterable[envelope_pb2.Envelope]) -> Frontier | None:
        best: envelope_pb2.Envelope | None = None
        for env in envelopes:
            if best is None or env.hop_count >= best.hop_count:
                best = env
        return None if best is None else Frontier(best.hop_count, tuple(best.trail))


@dataclass(frozen=True)
class OutboxEntry:
    """A message to an IOA agent kept in this mesh's outbox until the far side is reachable
    (OutboxStore; services.ioa.relay)."""
    number: int
    """Its place in the outbox (increasing; 0 before it is added)."""
    sender: str
    """The local agent that sent it."""
    envelope: envelope_pb2.Envelope
    """As the relay publishes it (recipient an `ioa:<node>/<agent>` address)."""
    expires_at_us: int
    """When it is given up on unsent (its outcome: expired)."""
    added_at_us: int


@dataclass(frozen=True)
class OutboxAdded:
    """What OutboxStore.outbox_add did with one entry."""
    number: int
    """The entry's number: a new one, or that of the entry the same sender's same message id has in the
    outbox already; 0 when refused because the outbox holds its limit."""
    new: bool
    """Whether this call made the entry (False: a retry, or refused). Of adds of one message id at the same
    moment exactly one makes it, and the others get its number."""


@dataclass(frozen=True)
class MessageRecord:
    envelope: envelope_pb2.Envelope
    state: int
    attempts: int
    stored_at_us: int
    delivered_at_us: int = 0
    consumed_at_us: int = 0
    dead_at_us: int = 0
    dead_reason: str = ""


@dataclass(frozen=True)
class CloseOutcome:
    closed: list[AgentRecord]
    """Agents this call closed (the target first, then descendants)."""
    dead_lettered: list[MessageRecord]
    notices: list[envelope_pb2.Envelope] = field(default_factory=list)
    """Dead-letter notices stored in the senders' inboxes (to deliver)."""


@dataclass(frozen=True)
class EventQuery:
    message_id: str = ""
    sender: str = ""
    agent_id: str = ""
    kinds: tuple[int, ...] = ()
    after_event_id: int = 0
    limit: int = 100


@dataclass(frozen=True)
class DeliveryBatch:
    """What a subscription should stream next for one agent."""

    messages: list[envelope_pb2.Envelope]
    dead_lettered: list[MessageRecord]
    """Messages found expired or over the attempt limit instead of delivered."""
    recipient_open: bool
    notices: list[envelope_pb2.Envelope] = field(default_factory=list)
    """Dead-letter notices stored in the senders' inboxes (to deliver)."""
    close_reason: str = ""
    """Why the recipient was closed (when it is)."""
    held_back: bool = False
    """Messages may be waiting beyond the recipient's capacity (see next_deliveries' `in_flight`): read
    again after the subscriber acks."""
    drained: bool = False
    """No message followed the ones returned when the inbox was read: a full batch need not be followed by
    another read until something is appended (a store that does not know says False)."""


@dataclass(frozen=True)
class Closes:
    """Agents closed after a cursor (InboxStore.closes_since)."""

    closed: list[tuple[str, str]]
    """(agent_id, close reason) of each close found, in the order they were made."""
    cursor: int
    """Where the next call goes on from: after the last close (or write) this call read."""
    more: bool = False
    """The page was full: more may follow at once (call again with `cursor`)."""


@dataclass(frozen=True)
class SpawnLimits:
    """Limits checked atomically when a child is registered."""

    max_depth: int
    """Deepest child allowed (a top-level agent has depth 0)."""
    max_active_children: int
    """Runs of one requester that may be running at once."""


RunRecord = runs_pb2.SubagentRun
"""Run records are `inboxmesh.runs.v1.SubagentRun` protobufs, as they travel."""
ANNOUNCE_WAITING = runs_pb2.ANNOUNCE_STATE_WAITING
ANNOUNCE_PENDING = runs_pb2.ANNOUNCE_STATE_PENDING
ANNOUNCED = runs_pb2.ANNOUNCE_STATE_ANNOUNCED
REQUESTER_GONE = runs_pb2.ANNOUNCE_STATE_REQUESTER_GONE
ANNOUNCE_ID_PREFIX = RESERVED_ID_PREFIX + "announce:"


@dataclass(frozen=True)
class AnnounceOutcome:
    run: RunRecord
    envelope: envelope_pb2.Envelope | None = None
    """The announce as stored (to deliver) when this call stored it."""
    retry: bool = False
    """True when it could not be stored yet (requester's inbox full)."""


@dataclass(frozen=True)
class RunWork:
    """Runs the sweeper has to act on."""

    overdue: list[str]
    """Running past their deadline."""
    pending: list[str]
    """Ended, announce not stored yet."""
    cleanup: list[str]
    """Announce settled, cleanup not done."""
    archivable: list[str]
    """Settled and past their archive time."""


EventRecord = events_pb2.Event


@dataclass(frozen=True, slots=True)
class EventRow:
    """An event as a store records it, before it has an id: what commit listeners receive (with the id
    of the first row), and the columns of the SQLite events table, in field order."""

    at_us: int
    kind: int
    agent_id: str
    message_id: str = ""
    sender: str = ""
    recipient: str = ""
    seq: int = 0
    """The inbox sequence (Event.sequence)."""
    detail: str = ""
    trace_id: str = ""
    turn: int = 0
    in_reply_to: str = ""
    conversation_id: str = ""

    def values(self) -> tuple[int, int, str, str, str, str, int, str, str, int, str, str]:
        """The fields in order (a row to insert)."""
        return (self.at_us, self.kind, self.agent_id, self.message_id, self.sender, self.recipient, self.seq,
                self.detail, self.trace_id, self.turn, self.in_reply_to, self.conversation_id)

    def event(self, event_id: int) -> EventRecord:
        """The Event message of this row, with its id."""
        return events_pb2.Event(
            event_id=event_id, at_us=self.at_us, kind=cast(events_pb2.EventKind, self.kind), agent_id=self.agent_id,
            message_id=self.message_id, sender=self.sender, recipient=self.recipient, sequence=self.seq,
            detail=self.detail, trace_id=self.trace_id, turn=self.turn, in_reply_to=self.in_reply_to,
            conversation_id=self.conversation_id,
        )

    @staticmethod
    def of(event: EventRecord) -> EventRow:
        """The row of an Event message (its id left behind)."""
        return EventRow(event.at_us, event.kind, event.agent_id, message_id=event.message_id, sender=event.sender,
                        recipient=event.recipient, seq=event.sequence, detail=event.detail,
                        trace_id=event.trace_id, turn=event.turn, in_reply_to=event.in_reply_to,
                        conversation_id=event.conversation_id)


EVENT_ROW_FIELDS = tuple(f.name for f in fields(EventRow))
"""The names of EventRow's fields, in order (the SQLite events table's columns)."""

CommitListener = Callable[[int, list[EventRow]], None]
"""Called with (id of the first row, rows) after a commit that recorded events; ids are contiguous."""

RECEIPT_NAME = {
    value: inbox_pb2.ReceiptStatus.Name(value).removeprefix("RECEIPT_STATUS_").lower()
    for value in inbox_pb2.ReceiptStatus.values()
}
"""The detail of a sent event: the receipt status's name ("accepted", "inbox_full", ...)."""
RECEIPT_ENUM_NAME = {value: inbox_pb2.ReceiptStatus.Name(value) for value in inbox_pb2.ReceiptStatus.values()}
"""The status's enum name ("RECEIPT_STATUS_ACCEPTED"), as spans carry it: looked up, not made per message."""


class AgentStore(abc.ABC):
    """Agents and their scopes: registration, look-up, close, credentials."""

    @abc.abstractmethod
    async def create_agent(self, record: AgentRecord) -> AgentRecord:
        """Store a new agent. Raises FailedPrecondition when its parent is
        closed, NotFound when the parent does not exist."""

    @abc.abstractmethod
    async def get_agent(self, agent_id: str) -> AgentRecord | None: ...

    @abc.abstractmethod
    async def find_agents(self, scope_id: str, name: str, include_closed: bool) -> list[AgentRecord]: ...

    @abc.abstractmethod
    async def list_agents(
        self, *, scope_id: str = "", parent_id: str = "", include_closed: bool, after_key: str, limit: int
    ) -> list[AgentRecord]:
        """Agents in creation order; `after_key` is the last agent_id seen."""

    @abc.abstractmethod
    async def close_agent(self, agent_id: str, reason: str, at_us: int) -> CloseOutcome:
        """Close the agent and all its open descendants, dead-letter their
        unconsumed messages and notify the senders, atomically. Runs of the
        closed agents that had not ended end with RUN_STATUS_CLOSED (their
        announce pending) in the same commit."""

    @abc.abstractmethod
    async def set_credential(self, agent_id: str, credential_hash: bytes) -> AgentRecord:
        """Replace an open agent's credential (earlier ones stop working)."""


class InboxStore(abc.ABC):
    """Inboxes: append, delivery, acks, the loop guard's frontier, dead letters."""

    fresh_delivery = True
    """Whether just-appended messages may be streamed from memory
    (mark_delivered): inbox sequences are contiguous and this process sees
    every append. False for a store shared by several processes."""

    def add_append_listener(self, callback: Callable[[str], None]) -> None:
        """Call `callback(agent_id)` when another process appended to that
        agent's inbox (a store only one process uses never does)."""
        return  # nothing to register: only this process appends

    @abc.abstractmethod
    async def append(self, sender_id: str, items: list[AppendItem], at_us: int) -> list[SendOutcome]:
        """Store the messages in order, one outcome each. Duplicate, target
        closed, sender closed and inbox full are decided here atomically."""

    @abc.abstractmethod
    async def append_groups(self, groups: list[tuple[str, list[AppendItem]]],
                            at_us: int) -> list[list[SendOutcome]]:
        """Several appends (sender id, its messages), each as `append` would store it, the outcomes of
        each group in turn, accepted as if appended one after the other in the order given: per sender
        and per inbox, sequences follow that order (the requests of one SendStream). As few writes as
        the store allows: on SQLite one (one commit); on JetStream one append, each recipient's messages
        published in that order whatever their senders (InboxLog.append_many; a batch naming a sender's
        message id twice or counting a conversation budget: a group starts once the earlier ones sharing
        its sender or a recipient have returned, services.store.ordering). A failure is raised; on
        SQLite nothing of the groups is stored, on JetStream what an inbox holds is still a front of
        what was sent to it in order (a retry with the same ids reads DUPLICATE for it)."""

    @abc.abstractmethod
    async def next_deliveries(
        self, recipient: str, after_sequence: int, limit: int, max_attempts: int, now_us: int, in_flight: int = 0
    ) -> DeliveryBatch:
        """Unconsumed messages after `after_sequence`, in order, marked
        delivered with their attempt counted. Expired messages and messages
        over the attempt limit are dead-lettered instead (senders notified).
        `in_flight`: how many earlier messages the subscriber holds unacked (a store that settles capacity
        after appending delivers only messages within the recipient's capacity)."""

    @abc.abstractmethod
    async def closes_since(self, cursor: int | None, limit: int) -> Closes:
        """Agents closed by any process after `cursor` (a value an earlier call returned), oldest first, at
        most `limit` (and `more` set when that cut the page short). `cursor` None: nothing is returned
        but the current position, to follow from. One bounded read: its cost grows with the closes (or,
        on a store that cannot tell closes from other agent writes, the agent writes) made since the
        cursor, never with the number of agents. Delivery streams use it to notice closes made
        elsewhere without reading every feed."""

    @abc.abstractmethod
    async def mark_delivered(
        self, recipient: str, envelopes: list[envelope_pb2.Envelope], at_us: int
    ) -> asyncio.Future:
        """Record the first delivery of freshly appended messages streamed
        straight from memory. Returns once the write is queued behind every
        earlier write (so a later ack is ordered after it); the returned
        future resolves when it is durable."""

    @abc.abstractmethod
    async def ack(self, recipient: str, sequences: list[int], at_us: int, turn: int = 0) -> list[AckOutcome]:
        """Consume; in the same write, the recipient's Frontier becomes that of the messages this ack
        consumed (if it consumed any)."""

    @abc.abstractmethod
    async def ack_many(self, entries: list[tuple[str, list[int], int]], at_us: int) -> list[list[AckOutcome]]:
        """Several acks (recipient, sequences, turn), each as `ack` would do it, in as few writes as the
        store allows (the acks of many agents in one request): on SQLite one commit; on JetStream the
        state changes of all entries at once, then their deletes, events and frontiers together. The
        outcomes of each entry in turn."""

    @abc.abstractmethod
    async def get_frontier(self, agent_id: str) -> Frontier | None:
        """The agent's Frontier as its last consuming ack left it (None: it never consumed anything). A
        send asks for it once the mesh took the request, before the store is asked to append
        (AppendItem.taken_at)."""

    @abc.abstractmethod
    async def get_message_by_sender(self, sender: str, message_id: str) -> MessageRecord | None: ...

    @abc.abstractmethod
    async def get_message_by_inbox(self, recipient: str, sequence: int) -> MessageRecord | None: ...

    @abc.abstractmethod
    async def list_dead_letters(
        self, *, recipient: str = "", sender: str = "", after_key: str, limit: int
    ) -> tuple[list[MessageRecord], str]:
        """Dead letters in the order they died; returns (page, next key)."""


class RunStore(abc.ABC):
    """Subagent runs (spawn, end, announce, cleanup, archive, the sweeper's work) and routing sessions."""

    @abc.abstractmethod
    async def create_child(self, record: AgentRecord, run: RunRecord, limits: SpawnLimits, *,
                           resume: bool = False) -> AgentRecord:
        """Store a new child and its run in one commit. Raises
        ResourceExhausted (SPAWN_DEPTH / TOO_MANY_CHILDREN) when a limit
        refuses it, plus what create_agent raises. `resume`: the agent was
        stored by an earlier attempt whose run was not (a store that cannot
        write both in one commit); store what is missing."""

    @abc.abstractmethod
    async def get_run(self, *, run_id: str = "", child_id: str = "") -> RunRecord | None: ...

    @abc.abstractmethod
    async def list_runs(self, requester_id: str, include_archived: bool, after_key: str,
                        limit: int) -> list[RunRecord]:
        """Runs of one requester in creation order; `after_key` is the last run_id seen."""

    @abc.abstractmethod
    async def end_run(self, run_id: str, status: int, result: str, at_us: int,
                      traceparent: str = "") -> tuple[RunRecord, bool]:
        """End a running run (announce pending). Returns (run, already_ended):
        when it had ended before, nothing changes."""

    @abc.abstractmethod
    async def announce_run(self, run_id: str, at_us: int) -> AnnounceOutcome:
        """Store a pending announce in the requester's inbox as the child,
        with the run's stable announce id, and record the outcome, in one
        commit. A run whose announce is settled is returned unchanged."""

    @abc.abstractmethod
    async def finish_cleanup(self, run_id: str, detail: str, at_us: int) -> RunRecord: ...

    @abc.abstractmethod
    async def archive_run(self, run_id: str, at_us: int) -> RunRecord: ...

    @abc.abstractmethod
    async def run_work(self, now_us: int, limit: int) -> RunWork: ...

    @abc.abstractmethod
    async def session_agent(self, session_key: str, new_agent: AgentRecord) -> tuple[AgentRecord, bool]:
        """The agent of a routing session; `new_agent` is stored (and
        returned with True) when the session has none yet."""


class OutboxStore(abc.ABC):
    """The IOA outbox: messages to IOA agents kept until the far side is reachable, in order."""

    @abc.abstractmethod
    async def outbox_add(self, entries: list[OutboxEntry], limit: int) -> list[OutboxAdded]:
        """Add the entries (their `number` ignored) in order. For each, its number (a new one, or the number
        of the entry the same sender's same message id has in the outbox already: a retry; 0 for one
        refused because the outbox holds `limit` entries) and whether it is new."""

    @abc.abstractmethod
    async def outbox_list(self, after: int, limit: int) -> list[OutboxEntry]:
        """The entries numbered above `after`, in order, at most `limit`."""

    @abc.abstractmethod
    async def outbox_remove(self, entries: list[OutboxEntry]) -> None:
        """Remove the entries (done: their outcome reported). Removing one that is gone is no error."""


class EventStore(abc.ABC):
    """The event record: what happened to every message, agent and run."""

    others_events_told = False
    """Whether the commit listeners also get the events other processes on this store record (as those
    processes tell them: each at most once, in no order across processes, one now and then never, a
    notice lost), so a listener that sees a gap in the ids may wait a moment for it to fill before it
    reads the store."""

    @abc.abstractmethod
    async def list_events(self, query: EventQuery) -> list[EventRecord]: ...

    @abc.abstractmethod
    async def last_event_id(self) -> int: ...

    @abc.abstractmethod
    async def record_events(self, events: list[EventRecord], *, lazy: bool = True) -> list[int]:
        """Append events that are not a side effect of another store call.
        lazy: return once queued (written with the next commit, at the latest
        shortly after; returns []), ordered before every write this process
        makes after the call. Otherwise return their ids once durable, ordered
        after every earlier write."""

    @abc.abstractmethod
    def add_commit_listener(self, callback: CommitListener) -> None:
        """Call `callback(first_event_id, rows)` on the event loop after every
        commit that recorded events, rows with contiguous ids from first_event_id. Events written by another
        process are reported only where `others_events_told` (then as they are told: see there); watchers find
        the others by reading the store."""


class Store(AgentStore, InboxStore, RunStore, OutboxStore, EventStore):
    """Durable state of the mesh: every concern's interface, plus a lifecycle. All methods are
    coroutines; results are returned only after the change is durable. A service that needs one concern
    takes that interface, not this."""

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish queued writes and release resources. Safe to call twice."""

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Have `callback(why)` called once if the store is lost for good while it runs (it cannot recover
        by itself: on JetStream, a NATS connection its client closed and will not open again). The
        default: a store that is never lost so (SQLite's failures are per call)."""
