"""The IOA relay: a mesh's one connection to an IOA network.

Addresses (docs/ioa.md): a local agent X of a mesh whose relay node is N is
`ioa:N/X` to the world; an IOA peer (node R, agent Y) is `ioa:R/Y` to local
agents, in the sender and recipient fields of ordinary envelopes.

Outbound: a send to `ioa:R/Y` is published through this relay's connection
with the sender's real identity (N, X) and the envelope's fields in
headers. The relay of node R stores it in Y's inbox by the ordinary Send
path and answers with that Send's receipt, which becomes the sender's
receipt here: unknown targets, closed agents, full inboxes look exactly as
they do locally. Each Send of a message is one attempt (a random token in
the headers): when the connection drops or a receipt is lost on the way,
the relay publishes the same attempt again until its receipt comes, and the
receiving relay answers every copy of an attempt with the receipt of its
first storage, so a first send reads ACCEPTED however often the network
carried it; a Send of the same message again (a retry) is a new attempt and
reads DUPLICATE.

Inbound: a message addressed to (N, X) is stored in X's inbox through
InboxService, as sender `ioa:<from>` with origin IOA; its message id is the
IOA message id, so a message the network delivers again after a reconnect
comes back DUPLICATE and is never consumed twice. Nothing is filtered by
node id: a message from a sibling on this same node is delivered like any
other. A message that came from IOA is never published again, and hop
counts and the trail (services.ioa.trail) stop loops between relays.

Order: each message names the one its sender sent before it to the same
agent while that one has no receipt (header AFTER); the receiving relay
holds it until that one is answered, or for config.resequence_wait_s at
most (then an IOA_GAP), so a pair's messages are stored in the order sent
whatever order the network delivers them in (docs/ioa.md, "Order").
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import json
import logging
import os
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.status import CALL_ENDED, own_cancel
from inboxmesh.client.tracing import context_of, trace_id_of, tracer
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from services.clock import now_us
from services.config import IoaConfig
from services.ioa import trail as trails
from services.ioa.wire import (
    H,
    Refused,
    address_of,
    context_of_headers,
    from_address,
    to_envelope,
    to_message,
    trace_id,
)
from services.store.base import (
    ACCEPTED,
    DUPLICATE,
    IOA_PREFIX,
    NOT_PERMITTED,
    OUTBOXED,
    RECEIPT_ENUM_NAME,
    RECEIPT_NAME,
    RESERVED_ID_PREFIX,
    UNKNOWN_TARGET,
    EventStore,
    OutboxEntry,
    OutboxStore,
    SendOutcome,
)
from services.tls import channel_credentials

log = logging.getLogger(__name__)
PREFIX = IOA_PREFIX
RELAY_AGENT = "inboxmesh-relay"
"""The agent name relays use to talk to each other (receipts)."""
RECEIPTS_MEDIA_TYPE = "application/vnd.inboxmesh.receipts+json"
"""A relay's answer to another relay: [{for, attempt, status, sequence, stored_at_us, detail}, ...]."""
_RECEIPT_STATUS = {inbox_pb2.ReceiptStatus.Name(v).removeprefix("RECEIPT_STATUS_").lower(): v
                   for v in inbox_pb2.ReceiptStatus.values()}
NOTHING_SENT = Reason.IOA_DISCONNECTED
"""Reason of the Unavailable a publish raises when nothing reached the network."""
CONNECTION_LOST = Reason.IOA_CONNECTION_LOST
"""Reason of the Unavailable a publish raises when the connection ended after the write: the network may
have the message."""
OFFLINE_GRACE_S = 0.5
"""How long a send that has not reached the network yet waits for this relay's connection, or for a target
node the network says is not connected, before it answers UNAVAILABLE (nothing delivered, safe to retry):
a relay whose connection dropped is back well within this."""
OFFLINE_RETRY_S = 0.05
"""Pause between publishes to a node the network said is not connected."""
LOST_LOG_REPEAT_S = 60.0
"""While the relay is not connected, its failed attempts are logged once this long at most."""
KNOWN_NODES = 10_000
"""Nodes this relay remembers having heard from (a receipt, a message) since it started; beyond that, no
more are added. One of them that the network does not know now is taken for a node not connected yet, not
for one that does not exist: a network that restarted knows a node again only once it has reconnected."""
RECEIPT_MEMORY = 10_000
"""Receipts a receiving relay keeps (the latest, per sender and IOA id) with the attempt they answered: a
copy of that attempt gets the same receipt and is not stored again. Older copies go to the store, which
answers DUPLICATE."""
MEMORY_KEY_CHARS = 1_024
"""Longest sender address + IOA id + attempt the memory keeps (an inboxmesh relay's are far shorter)."""
PARKED_ANSWERS = 1_000
"""Answers (one IOA message of receipts each) kept while this relay is not connected, sent when it is
again; beyond that the oldest are dropped (their senders publish again and get them from the memory)."""

AFTER = H + "after"
"""Header: the IOA id of the message the same sender sent to the same agent before this one, while that
one has no receipt yet (per-pair order); the receiving relay stores this one only once that one is
answered, or its resequence wait is over."""
NOTICE = H + "notice"
"""Header of a notice the mesh made (a dead letter's, an outbox entry's outcome): what it is about."""
OUTBOX_POLL_S = 1.0
"""How often the relay looks at the outbox when nothing wakes it (entries the store adds itself)."""
OUTBOX_BACKOFF_S = 4.0
"""The longest pause between rounds while the outbox's entries cannot be sent."""
OUTBOX_ROUND = 256
"""Outbox entries sent in one round."""
PUBLISH_BATCH = 256
"""First copies written in one frame at most."""
SWEEP_S = 0.25
"""How often the receiving relay looks for held messages whose resequence wait is over."""

DeliverFromIoa = Callable[[list[env_pb.Envelope]], Awaitable[list[SendOutcome]]]
"""Stores inbound messages by the ordinary inbox path, one receipt each
(services.inbox.writer.InboxWriter.deliver_from_ioa)."""
StoreNotice = Callable[[env_pb.Envelope], Awaitable[SendOutcome]]
"""Stores a notice the mesh made in a local agent's inbox (services.inbox.writer.InboxWriter.deliver_notice)."""
StoredMessage = Callable[[str, str], Awaitable[Any]]
"""The stored message a sender sent with a message id, or None (MessageStore.get_message_by_sender): whether
a predecessor this relay has no memory of was stored (after a restart)."""
Pair = tuple[str, str]
"""(local sender, IOA recipient address): what per-pair order is kept for."""


@dataclass(eq=False)
class _Arrival:
    """A received IOA message on its way to the store: its sender's address and IOA id, its attempt, its
    ioa.receive span, and what it waits for (the predecessor's key), when held."""
    message: net.IoaMessage
    key: tuple[str, str]
    attempt: str
    span: trace.Span
    after: tuple[str, str] | None = None
    since: float = 0.0


class Forwarding:
    """Messages IoaRelay.start_forward published: `outcomes()` waits for their receipts."""

    def __init__(self, relay: IoaRelay, sender_id: str, envelopes: list[env_pb.Envelope],
                 outcomes: list[SendOutcome | None],
                 pending: list[tuple[int, str, net.IoaMessage, asyncio.Future, trace.Span]],
                 answers: asyncio.Future[list[Any]], outbox: bool = False, queued: list[int] | None = None):
        self.relay = relay
        self.sender_id = sender_id
        self.envelopes = envelopes
        self.outcomes_so_far = outcomes
        """Per message its outcome when refused before publishing, else None."""
        self.outbox = outbox
        """Whether a message whose node cannot be reached goes into the outbox (else UNAVAILABLE)."""
        self.queued = queued or []
        """Indexes of the messages that go into the outbox unpublished: their pair has entries there."""
        self.pending = pending
        """The published ones: (index, IOA id, message, its receipt's future, its span)."""
        self.answers = answers
        """Per published message, what publishing it until its receipt came to (IoaRelay._deliver)."""

    async def outcomes(self) -> list[SendOutcome]:
        """The receiving meshes' receipts, in the order of the messages (refusals as for `forward`)."""
        return await self.relay._receipts_of(self)


def _node_of(address: str) -> str:
    """The node of an `ioa:<node>/<agent>` address."""
    return address.removeprefix(PREFIX).split("/")[0]


def parse_address(address: str) -> tuple[str, str]:
    """(node, agent) of an `ioa:<node>/<agent>` address."""
    node, slash, agent = address.removeprefix(PREFIX).partition("/")
    if not address.startswith(PREFIX) or not slash or not node or not agent:
        raise errors.InvalidArgument(f"{address!r} is not an IOA address; expected 'ioa:<node>/<agent>'",
                                     reason=Reason.BAD_IOA_ADDRESS)
    return node, agent


class IoaRelay:
    def __init__(self, config: IoaConfig, events: EventStore, max_hops: int, deliver: DeliverFromIoa,
                 stored: StoredMessage, outbox: OutboxStore, store_notice: StoreNotice):
        self.config = config
        self._outbox = outbox
        self._store_notice = store_notice
        self._outboxed: dict[Pair, set[int]] = {}
        """Per pair, the numbers of its entries in the outbox (a send to the pair with the outbox chosen goes
        in behind them)."""
        self.outbox_wake = asyncio.Event()
        """Set to make the pump send the outbox now."""
        self.node_id = config.node_id
        self.relay_id = uuid.uuid4().hex[:12]
        self._events = events
        self._max_hops = max_hops
        self._deliver_inbound = deliver
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.spaces: set[str] = set()
        self._call: Any = None
        """The current Connect call (grpc's StreamStreamCall), None between connections."""
        self._lost: asyncio.Future[None] | None = None
        """Resolved when the current connection ends (None before start)."""
        self._write_lock = asyncio.Lock()
        self._in_order = asyncio.Lock()
        """Held by a start_forward while it writes its first copies: calls write them in the order they came."""
        self._publish_ids = itertools.count(1)
        self._published: dict[int, asyncio.Future] = {}
        self._receipts: dict[tuple[str, str], tuple[str, asyncio.Future]] = {}
        """(IOA id, attempt) of a message waiting for its receipt -> (the node that answers, the future)."""
        self._answered: collections.OrderedDict[tuple[str, str], tuple[str, SendOutcome]] = \
            collections.OrderedDict()
        """(sender address, IOA id) -> (attempt, its receipt): the receipt memory (RECEIPT_MEMORY)."""
        self._parked: collections.deque[net.IoaMessage] = collections.deque(maxlen=PARKED_ANSWERS)
        self._resend_s = max(0.2, config.receipt_timeout_s / 2)
        """A message whose receipt has not come this long after it was published is published again."""
        self._inbound: asyncio.Queue = asyncio.Queue(maxsize=config.inbound_queue)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._known_nodes: set[str] = set()
        """Nodes heard from (KNOWN_NODES)."""
        self._unanswered: dict[Pair, dict[tuple[str, str], str]] = {}
        """Per pair, its messages published and not answered yet, in publishing order: (IOA id, attempt) ->
        IOA id. A message published names the last of them (AFTER)."""
        self._stored = stored
        self._handled: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        """(sender address, IOA id) of the messages this relay answered (any receipt), the latest
        RECEIPT_MEMORY: a message held for one of them is stored."""
        self._held: collections.OrderedDict[tuple[str, str], _Arrival] = collections.OrderedDict()
        """Received messages waiting for their predecessors, oldest first (at most config.hold_limit)."""
        self._waiting: dict[tuple[str, str], list[tuple[str, str]]] = {}
        """A predecessor's key -> the keys of the held messages waiting for it."""

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        credentials = channel_credentials(self.config.tls, "the relay's IOA connection")
        self._channel = (grpc.aio.secure_channel(self.config.network, credentials) if credentials is not None else
                         grpc.aio.insecure_channel(self.config.network))
        self._network = network_pb2_grpc.IoaNetworkStub(self._channel)
        self._lost = asyncio.get_running_loop().create_future()
        for entry in await self._outbox.outbox_list(0, self.config.outbox_limit):  # kept across a restart
            self._outboxed.setdefault((entry.sender, entry.envelope.recipient), set()).add(entry.number)
        self._tasks = [asyncio.create_task(self._connection(), name="ioa-connection"),
                       asyncio.create_task(self._store_inbound(), name="ioa-inbound"),
                       asyncio.create_task(self._pump(), name="ioa-outbox")]

    async def stop(self) -> None:
        self._stopping = True
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._channel.close()

    @property
    def holding(self) -> int:
        """Received messages held for their predecessors now."""
        return len(self._held)

    async def wait_connected(self, timeout: float) -> None:
        await asyncio.wait_for(self.connected.wait(), timeout)

    async def _connection(self) -> None:
        failures = 0
        lost_logged = float("-inf")
        loop = asyncio.get_running_loop()
        while not self._stopping:
            call = self._network.Connect()
            if self._lost is None or self._lost.done():
                self._lost = loop.create_future()
            lost = self._lost
            try:
                async with self._write_lock:  # hello first: nothing may be written on the call before it
                    await call.write(net.NodeFrame(hello=net.Hello(node_id=self.node_id, batches=True)))
                    for space in sorted(self.spaces):
                        await call.write(net.NodeFrame(join=net.JoinSpace(space=space)))
                    self._call = call
                async for frame in call:
                    which = frame.WhichOneof("frame")
                    if which == "welcome":
                        self.connected.set()
                        log.log(logging.WARNING if failures else logging.INFO,
                                "relay %s connected to %s%s (%d recent messages come again)", self.node_id,
                                self.config.network, f" again after {failures} attempts" if failures else "",
                                frame.welcome.redelivering)
                        failures = 0
                        self.outbox_wake.set()
                        await self._send_parked()
                        continue
                    try:
                        await self._on_frame(frame)
                    except Exception:  # a bug, or a peer's message nothing foresaw: that frame only is lost
                        log.exception("relay %s could not handle a %s frame from the IOA network; skipped",
                                      self.node_id, which)
            except CALL_ENDED as exc:
                if self._stopping:
                    return
                if own_cancel(exc):
                    raise
                # else a CancelledError is the call's own: a write on it failed and cancelled it
                # (_write_publishes), and its reader ends so; the connection is lost like any other
                now = loop.time()  # the loss, then once a minute while it lasts (an attempt every 2 s at most)
                if failures == 0 or now - lost_logged >= LOST_LOG_REPEAT_S:
                    lost_logged = now
                    log.warning("relay %s lost the IOA network%s: %s", self.node_id,
                                f" ({failures} attempts to connect failed)" if failures else "",
                                exc.details() if isinstance(exc, grpc.aio.AioRpcError) else
                                "this relay ended the call (a write on it failed)"
                                if isinstance(exc, asyncio.CancelledError) else exc)
            finally:
                self.connected.clear()
                self._call = None
                call.cancel()
                for future in self._published.values():
                    if not future.done():
                        future.set_exception(errors.Unavailable("the IOA connection was lost; the network may or"
                                                                " may not have the message", reason=CONNECTION_LOST))
                self._published.clear()
                if not lost.done():
                    lost.set_result(None)
            if self._stopping:
                return
            failures += 1
            self.reconnects += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** min(failures, 6)) * (0.5 + random.random() / 2))

    async def _on_frame(self, frame: net.NetworkFrame) -> None:
        """A frame of the connection after its welcome: results of this relay's publishes, messages for it,
        NodeBack, alone or as the items of a Batch (whose item fields are named as the frame's)."""
        which = frame.WhichOneof("frame")
        if which == "batch":
            for item in frame.batch.items:
                kind = item.WhichOneof("item")
                if kind is not None:
                    await self._on_part(kind, getattr(item, kind))
        elif which is not None:
            await self._on_part(which, getattr(frame, which))

    async def _on_part(self, kind: str, part: Any) -> None:
        if kind == "result":
            self._result(part)
        elif kind == "node_back":
            self._node_back(part)
        elif kind == "message":
            await self._arrived(part)

    def _node_back(self, back: net.NodeBack) -> None:
        """A node this relay published to while it was away is connected again: the outbox is sent now,
        not at the end of its back-off."""
        self.counts["node_back"] += 1
        self._heard_from(back.node_id)
        self.outbox_wake.set()

    def _result(self, result: net.PublishResult) -> None:
        future = self._published.pop(result.publish_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    async def _publish(self, message: net.IoaMessage, *, timeout: float | None = None) -> net.PublishResult:
        """Write one message on the connection and return the network's
        PublishResult. Unavailable (NOTHING_SENT) when it could not be
        written, (CONNECTION_LOST) when the connection ended before the result
        came; TimeoutError when the result takes longer than timeout."""
        future: asyncio.Future[net.PublishResult] = asyncio.get_running_loop().create_future()
        publish_id = await self._write_publish(message, future)
        try:
            return await asyncio.wait_for(future, self.config.receipt_timeout_s if timeout is None else timeout)
        finally:
            self._published.pop(publish_id, None)

    async def _publish_unanswered(self, message: net.IoaMessage) -> None:
        """Write one message on the connection without waiting for the network's result (Unavailable as
        _publish when it could not be written)."""
        await self._write_publish(message, None)

    async def _write_publish(self, message: net.IoaMessage, future: asyncio.Future | None) -> int:
        """Write a Publish frame; the future (when given) gets its result. Returns the publish id."""
        return (await self._write_publishes([message], [future]))[0]

    async def _write_publishes(self, messages: list[net.IoaMessage], futures: list[asyncio.Future | None]) -> list[int]:
        """Write messages in one frame (a Publish, or a PublishBatch for several); each future (when given)
        gets its message's result. Their publish ids."""
        ids = [next(self._publish_ids) for _ in messages]
        async with self._write_lock:
            call = self._call
            if not self.connected.is_set() or call is None:
                raise errors.Unavailable(f"relay {self.node_id} is not connected to the IOA network; nothing was"
                                         " sent", reason=NOTHING_SENT)
            for publish_id, future in zip(ids, futures):
                if future is not None:
                    self._published[publish_id] = future
            publishes = [net.Publish(message=m, publish_id=i) for m, i in zip(messages, ids)]
            try:
                await call.write(net.NodeFrame(publish=publishes[0]) if len(publishes) == 1 else
                                 net.NodeFrame(publish_batch=net.PublishBatch(publishes=publishes)))
            except CALL_ENDED as exc:
                if own_cancel(exc):
                    raise
                for publish_id in ids:
                    self._published.pop(publish_id, None)
                self.connected.clear()  # the call is over: no publish may wait for it (the loop reconnects)
                call.cancel()
                raise errors.Unavailable(f"could not publish to the IOA network ({type(exc).__name__}); nothing"
                                         " was sent", reason=NOTHING_SENT) from None
        return ids

    # -- outbound -----------------------------------------------------------
    async def forward(self, sender_id: str, envelopes: list[env_pb.Envelope]) -> list[SendOutcome]:
        """Publish local agents' messages to IOA addresses, in order (one
        stream, so the network keeps the order), without waiting for each
        before the next; return the receiving meshes' receipts."""
        return await (await self.start_forward(sender_id, envelopes)).outcomes()

    async def start_forward(self, sender_id: str, envelopes: list[env_pb.Envelope], outbox: bool | None = None, *,
                            pumping: bool = False) -> Forwarding:
        """Publish the first copies of local agents' messages to IOA addresses, in order, and return what
        waits for their receipts (Forwarding.outcomes). Calls write their first copies in the order they
        were made, whatever their receipts: a SendStream's requests go out one after the other without
        each waiting for the receipts of the one before (InboxService).

        outbox: whether a message whose node cannot be reached goes into the outbox (None: as configured);
        then a message whose pair has entries in the outbox goes in behind them, unpublished (order).
        pumping: the outbox's own entries, sent by the pump."""
        use_outbox = not pumping and (self.config.outbox if outbox is None else outbox)
        outcomes: list[SendOutcome | None] = [None] * len(envelopes)
        pending: list[tuple[int, str, net.IoaMessage, asyncio.Future, trace.Span]] = []
        queued: list[int] = []
        loop = asyncio.get_running_loop()
        for index, env in enumerate(envelopes):
            refused = self._refuse(env)
            try:
                trail = trails.encode(env.trail, node=self.node_id, sender=sender_id, max_entries=self._max_hops)
            except trails.TrailRefused as exc:
                refused = refused or SendOutcome(env.message_id, env.recipient, NOT_PERMITTED, detail=str(exc))
            if refused is not None:
                outcomes[index] = refused
                continue
            if use_outbox and self._outboxed.get((sender_id, env.recipient)):
                queued.append(index)
                continue
            node, agent = parse_address(env.recipient)
            ioa_id = f"{self.node_id}:{sender_id}:{env.message_id}"
            attempt = os.urandom(8).hex()
            span = tracer.start_span("ioa.publish", context=context_of(env),
                                     attributes={"inboxmesh.ioa.message_id": ioa_id, "inboxmesh.ioa.to": node})
            future = loop.create_future()
            self._receipts[(ioa_id, attempt)] = (node, future)
            message = to_message(env, node=self.node_id, relay_id=self.relay_id, sender_id=sender_id, ioa_id=ioa_id,
                                 to=(node, agent), attempt=attempt, trail=trail, span=span)
            # per-pair order: name the pair's last message still without its receipt (published in this
            # order: the calls take _in_order in the order they build their messages, with no await between)
            unanswered = self._unanswered.setdefault((sender_id, env.recipient), {})
            if unanswered:
                message.headers[AFTER] = next(reversed(unanswered.values()))
            unanswered[(ioa_id, attempt)] = ioa_id
            pending.append((index, ioa_id, message, future, span))
        firsts: list[asyncio.Future[net.PublishResult]] = []
        try:
            async with self._in_order:  # FIFO: the calls write their first copies in the order they came
                if pending:
                    await self._events.record_events([ev.Event(
                        kind=ev.EVENT_KIND_IOA_PUBLISHED, at_us=now_us(), agent_id=envelopes[i].recipient,
                        message_id=envelopes[i].message_id, sender=sender_id, recipient=envelopes[i].recipient,
                        detail=ioa_id, trace_id=trace_id_of(envelopes[i].trace.traceparent),
                        in_reply_to=envelopes[i].in_reply_to, conversation_id=envelopes[i].conversation_id)
                        for i, ioa_id, *_ in pending])  # handed to the network
                for start in range(0, len(pending), PUBLISH_BATCH):  # a frame for many
                    firsts += await self._write_firsts([message for _, _, message, _, _ in
                                                        pending[start:start + PUBLISH_BATCH]])
        except BaseException:
            self._forgotten(pending, sender_id, envelopes)
            raise
        deadline = loop.time() + self.config.receipt_timeout_s
        # each message's copies published again as needed from now on, whenever its receipts are asked for
        answers = asyncio.gather(*(self._deliver_in_pair((sender_id, envelopes[index].recipient), message, future,
                                                         deadline, first)
                                   for (index, _, message, future, _), first in zip(pending, firsts)),
                                 return_exceptions=True)
        answers.add_done_callback(lambda _: self._forgotten(pending, sender_id, envelopes))  # nothing waits now
        return Forwarding(self, sender_id, envelopes, outcomes, pending, answers, use_outbox, queued)

    def _forgotten(self, pending: list[tuple[int, str, net.IoaMessage, asyncio.Future, trace.Span]], sender_id: str,
                   envelopes: list[env_pb.Envelope]) -> None:
        """Stop waiting for these messages' receipts."""
        for index, _, message, _, span in pending:
            self._receipts.pop((message.ioa_message_id, message.headers[H + "attempt"]), None)
            self._answered_in_pair((sender_id, envelopes[index].recipient), message)
            span.end()

    async def _deliver_in_pair(self, pair: Pair, message: net.IoaMessage, receipt: asyncio.Future, deadline: float,
                               first: asyncio.Future[net.PublishResult]) -> dict | net.PublishResult:
        """_deliver; once it ends (a receipt, a refusal, the deadline), the pair's later messages no longer
        name this one."""
        try:
            return await self._deliver(message, receipt, deadline, first)
        finally:
            self._answered_in_pair(pair, message)

    def _answered_in_pair(self, pair: Pair, message: net.IoaMessage) -> None:
        unanswered = self._unanswered.get(pair)
        if unanswered is not None:
            unanswered.pop((message.ioa_message_id, message.headers[H + "attempt"]), None)
            if not unanswered:
                del self._unanswered[pair]

    async def _write_firsts(self, messages: list[net.IoaMessage]) -> list[asyncio.Future[net.PublishResult]]:
        """Write messages' first copies now, in one frame; each future gets the network's PublishResult, or
        the Unavailable the write (or the connection ending before the result) came to."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[net.PublishResult]] = [loop.create_future() for _ in messages]
        try:
            await self._write_publishes(messages, list(futures))
        except errors.Unavailable as exc:
            for future in futures:
                if not future.done():  # the connection's end may have failed it first
                    future.set_exception(exc)
        for future in futures:
            if future.done():
                future.exception()  # retrieved: _deliver reads it, or its forwarding is cancelled first
        return futures

    async def _receipts_of(self, forwarding: Forwarding) -> list[SendOutcome]:
        """The receipts of what start_forward published (Forwarding.outcomes); with the outbox, the messages
        whose node could not be reached (and those queued behind entries of their pair) go into it, in
        order, and are answered OUTBOXED."""
        envelopes, outcomes, pending = forwarding.envelopes, forwarding.outcomes_so_far, forwarding.pending
        answers = await forwarding.answers
        queued = list(forwarding.queued)
        for (index, *_), answer in zip(pending, answers):
            env = envelopes[index]
            if isinstance(answer, TimeoutError):
                raise errors.DeadlineExceeded(  # not UNAVAILABLE: the outcome is unknown, so no automatic retry
                    f"no receipt from the IOA network within {self.config.receipt_timeout_s:.0f}s; the message may"
                    " or may not have arrived: retry with the same message_id (DUPLICATE then means it had)",
                    reason=Reason.IOA_NO_RECEIPT)
            if isinstance(answer, dict):
                self.counts["forwarded"] += 1
                outcomes[index] = self._outcome_of(env, answer)
                continue
            failure = self._failure(env, answer)
            if failure is None:
                outcomes[index] = SendOutcome(env.message_id, env.recipient, UNKNOWN_TARGET,
                                              detail=f"no IOA node {_node_of(env.recipient)!r}")
            elif forwarding.outbox and self._unreachable(answer):
                queued.append(index)
            else:
                raise failure
        if queued:
            await self._into_outbox(forwarding.sender_id, envelopes, sorted(queued), outcomes)
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(envelopes), "every message was refused above, has its receipt or is in the outbox"
        await self._record_outbound(forwarding.sender_id, envelopes, done)
        return done

    def _failure(self, env: env_pb.Envelope, answer: BaseException | net.PublishResult) -> BaseException | None:
        """What a message that got no receipt fails its Send with; None for a node the network does not know
        and this relay never heard from (UNKNOWN_TARGET)."""
        if isinstance(answer, BaseException):
            return answer
        if answer.status == net.PUBLISH_STATUS_UNKNOWN_NODE:
            node = _node_of(env.recipient)
            if not self._may_return(node):
                return None
            return errors.Unavailable(
                f"the IOA network does not know node {node!r} now, and this relay has heard from it: a"
                " network that restarted knows a node once it reconnects; nothing was delivered, retry"
                " with the same message_id", reason=Reason.IOA_PUBLISH_STATUS_UNKNOWN_NODE)
        return errors.Unavailable(f"the IOA network did not take the message for {env.recipient}:"
                                  f" {answer.detail}; nothing was delivered, retry with the same"
                                  " message_id", reason=Reason("IOA_" + net.PublishStatus.Name(answer.status)))

    @staticmethod
    def _unreachable(answer: BaseException | net.PublishResult) -> bool:
        """Whether a message that got no receipt never reached its node because the node (or the network)
        could not be reached: nothing was delivered, and the outbox may keep it."""
        if isinstance(answer, errors.Unavailable):
            return answer.reason == NOTHING_SENT
        return isinstance(answer, net.PublishResult) and answer.status in (net.PUBLISH_STATUS_NODE_OFFLINE,
                                                                            net.PUBLISH_STATUS_UNKNOWN_NODE)

    # -- the outbox ---------------------------------------------------------------
    async def _into_outbox(self, sender_id: str, envelopes: list[env_pb.Envelope], indexes: list[int],
                           outcomes: list[SendOutcome | None]) -> None:
        """Keep these messages in the outbox, in order, and answer them OUTBOXED (their entry's number);
        UNAVAILABLE / IOA_OUTBOX_FULL when the outbox holds its limit (what was added before stays)."""
        at = now_us()
        ttl_us = int(self.config.outbox_ttl_s * 1e6)
        entries = [OutboxEntry(0, sender_id, envelopes[i], min(envelopes[i].expires_at_us or at + ttl_us,
                                                               at + ttl_us), at) for i in indexes]
        # the store says which entries this add made: the others are retries (no second IOA_OUTBOXED)
        added = await self._outbox.outbox_add(entries, self.config.outbox_limit)
        events = []
        for index, entry, result in zip(indexes, entries, added):
            number = result.number
            if not number:
                raise errors.Unavailable(
                    f"node of {errors.clip(entry.envelope.recipient)} cannot be reached and the outbox holds its"
                    f" limit of {self.config.outbox_limit} messages; nothing was sent or kept, retry later",
                    reason=Reason.IOA_OUTBOX_FULL)
            env = entry.envelope
            retry = not result.new
            self._outboxed.setdefault((sender_id, env.recipient), set()).add(number)
            outcomes[index] = SendOutcome(env.message_id, env.recipient, OUTBOXED, number, at, detail=(
                f"node {_node_of(env.recipient)!r} cannot be reached now: "
                f"{'already in' if retry else 'kept in'} this mesh's outbox (entry {number}) and sent when it can"
                " be; the outcome comes as a notice"))
            if retry:
                continue
            events.append(ev.Event(kind=ev.EVENT_KIND_IOA_OUTBOXED, at_us=at, agent_id=sender_id,
                                   message_id=env.message_id, sender=sender_id, recipient=env.recipient,
                                   sequence=number, trace_id=trace_id_of(env.trace.traceparent),
                                   in_reply_to=env.in_reply_to, conversation_id=env.conversation_id,
                                   detail=f"outbox entry {number}"))
        await self._events.record_events(events, lazy=False)
        self.outbox_wake.set()

    async def _pump(self) -> None:
        """Send the outbox's entries whenever the relay is connected: at start, when entries are added,
        on every reconnect, and every OUTBOX_POLL_S (entries the store adds: dead-letter notices for IOA
        senders). Entries whose node cannot be reached stay, and are tried again later (backing off)."""
        backoff = OUTBOX_POLL_S
        while not self._stopping:
            try:
                await asyncio.wait_for(self.outbox_wake.wait(), backoff)
            except TimeoutError:
                pass
            self.outbox_wake.clear()
            if not self.connected.is_set():
                continue  # the reconnect wakes it
            try:
                sent, more = await self._pump_round()
            except Exception:  # the store or the network failed: the entries stay, and are tried again
                log.exception("relay %s could not send its outbox", self.node_id)
                sent, more = False, False
            backoff = OUTBOX_POLL_S if sent or not more else min(backoff * 2, OUTBOX_BACKOFF_S)
            if sent and more:
                self.outbox_wake.set()

    async def _pump_round(self) -> tuple[bool, bool]:
        """Send (or expire) the first OUTBOX_ROUND entries, one forwarding per sender, pipelined. Returns
        (whether an entry ended, whether entries remain)."""
        entries = await self._outbox.outbox_list(0, OUTBOX_ROUND)
        pairs: dict[Pair, set[int]] = {}
        for entry in entries:
            pairs.setdefault((entry.sender, entry.envelope.recipient), set()).add(entry.number)
        if len(entries) < OUTBOX_ROUND:
            self._outboxed = pairs  # all of them: entries others added are known from now on
        at = now_us()
        ended: list[tuple[OutboxEntry, str, SendOutcome | None]] = []
        by_sender: dict[str, list[OutboxEntry]] = {}
        for entry in entries:
            if entry.expires_at_us <= at:
                ended.append((entry, "expired", None))
            else:
                by_sender.setdefault(entry.sender, []).append(entry)

        async def send(sender: str, batch: list[OutboxEntry]) -> None:
            copies = [env_pb.Envelope() for _ in batch]
            for copy, entry in zip(copies, batch):
                copy.CopyFrom(entry.envelope)
            forwarding = await self.start_forward(sender, copies, pumping=True)
            answers = await forwarding.answers
            published = {index: answer for (index, *_), answer in zip(forwarding.pending, answers)}
            for index, entry in enumerate(batch):
                answer = published.get(index)
                refused = forwarding.outcomes_so_far[index]
                if refused is not None:
                    ended.append((entry, RECEIPT_NAME[refused.status], refused))
                elif isinstance(answer, dict):
                    outcome = self._outcome_of(entry.envelope, answer)
                    ended.append((entry, RECEIPT_NAME[outcome.status], outcome))
                elif isinstance(answer, net.PublishResult) and answer.status == net.PUBLISH_STATUS_INVALID:
                    ended.append((entry, "not_permitted", SendOutcome(
                        entry.envelope.message_id, entry.envelope.recipient, NOT_PERMITTED,
                        detail=f"the IOA network refused it: {answer.detail}"[:1000])))
                # else not reached (or no receipt yet): it stays, tried again later

        await asyncio.gather(*(send(sender, batch) for sender, batch in by_sender.items()))
        for entry, status, outcome in sorted(ended, key=lambda e: e[0].number):
            await self._report(entry, status, outcome)
        return bool(ended), len(entries) > len(ended)

    async def _report(self, entry: OutboxEntry, status: str, outcome: SendOutcome | None) -> None:
        """An entry's outcome, to its sender: an IOA_OUTBOX_DONE event and a notice in its inbox (one id per
        entry's message: reported again after a crash, it is stored once); then the entry is removed. A
        dead-letter notice crossing back gets no notice about itself."""
        env, at = entry.envelope, now_us()
        detail = outcome.detail if outcome is not None else ""
        events = [ev.Event(kind=ev.EVENT_KIND_IOA_OUTBOX_DONE, at_us=at, agent_id=entry.sender,
                           message_id=env.message_id, sender=entry.sender, recipient=env.recipient,
                           sequence=outcome.sequence if outcome is not None else 0,
                           trace_id=trace_id_of(env.trace.traceparent), in_reply_to=env.in_reply_to,
                           conversation_id=env.conversation_id, detail=f"{status}: {detail}" if detail else status)]
        if NOTICE not in env.headers:
            told = {"accepted": f"was stored there (sequence {outcome.sequence if outcome else 0})",
                    "duplicate": "was stored there before (a retry)",
                    "expired": f"expired in this mesh's outbox: its node could not be reached by"
                               f" {entry.expires_at_us} us"}.get(status, f"was not stored there: {status} ({detail})")
            digest = hashlib.sha256(f"{entry.sender}\x00{env.message_id}".encode()).hexdigest()[:32]
            notice = env_pb.Envelope(
                message_id=f"{RESERVED_ID_PREFIX}outbox:{digest}",  # one per entry's message: stored once
                sender=env.recipient, recipient=entry.sender, kind=env_pb.MESSAGE_KIND_CONTROL,
                content=env_pb.Content(text=f"Your message {env.message_id} to {env.recipient} {told}."),
                in_reply_to=env.message_id, conversation_id=env.conversation_id, trace=env.trace,
                origin=env_pb.Origin(kind=env_pb.ORIGIN_KIND_MESH),
                headers={NOTICE: "ioa-outbox", H + "outcome": status}, created_at_us=at)
            stored = await self._store_notice(notice)
            if stored.status not in (ACCEPTED, DUPLICATE):
                events.append(ev.Event(
                    kind=ev.EVENT_KIND_NOTICE_UNDELIVERED, at_us=at, agent_id=entry.sender,
                    message_id=notice.message_id, sender=env.recipient, recipient=entry.sender,
                    detail=f"{RECEIPT_NAME[stored.status]}; the outbox's {env.message_id} ended {status}"))
        await self._events.record_events(events, lazy=False)
        await self._outbox.outbox_remove([entry])
        self.counts["outbox_done"] += 1
        numbers = self._outboxed.get((entry.sender, env.recipient))
        if numbers is not None:
            numbers.discard(entry.number)
            if not numbers:
                del self._outboxed[(entry.sender, env.recipient)]

    async def _deliver(self, message: net.IoaMessage, receipt: asyncio.Future, deadline: float,
                       first: asyncio.Future[net.PublishResult] | None = None) -> dict | net.PublishResult:
        """Publish one message until its receipt (a dict) comes back, or the
        network refuses it before any copy reached it (its PublishResult).
        After a copy may have reached the network, connections lost on the
        way, receipts lost on the way and a target node that is briefly
        offline are this relay's business: it publishes the same attempt
        again (after a reconnect, or when no receipt came within
        `_resend_s`), and the receiving relay answers every copy of it with
        the same receipt. TimeoutError at the deadline."""
        loop = asyncio.get_running_loop()
        reached = False  # a copy may be on the network: from then on only its receipt or the deadline ends this
        patience = min(deadline, loop.time() + OFFLINE_GRACE_S)
        while True:
            if receipt.done():  # it came while this waited for a connection (the network redelivers receipts too)
                return receipt.result()
            lost = self._lost
            try:
                if first is not None:  # written already (start_forward): its result
                    written, first = first, None
                    result = await asyncio.wait_for(written, max(0.0, deadline - loop.time()))
                else:
                    result = await self._publish(message, timeout=max(0.0, deadline - loop.time()))
            except errors.Unavailable as exc:
                reached = reached or exc.reason == CONNECTION_LOST
                try:
                    await asyncio.wait_for(self.connected.wait(), max(0.0, (deadline if reached else patience)
                                                                      - loop.time()))
                except TimeoutError:
                    if reached:
                        raise
                    raise exc from None
                continue
            offline = result.status == net.PUBLISH_STATUS_NODE_OFFLINE or (
                result.status == net.PUBLISH_STATUS_UNKNOWN_NODE and self._may_return(message.direct.node))
            if offline and (reached or loop.time() < patience):
                if loop.time() >= deadline:
                    raise TimeoutError
                await asyncio.sleep(OFFLINE_RETRY_S)  # a relay reconnecting, or one that is gone (the deadline)
                continue
            if result.status != net.PUBLISH_STATUS_OK:
                return result
            reached = True
            ends = {receipt} if lost is None else {receipt, lost}  # lost is None only before start()
            await asyncio.wait(ends, timeout=max(0.0, min(self._resend_s, deadline - loop.time())),
                               return_when=asyncio.FIRST_COMPLETED)
            if receipt.done():
                return receipt.result()
            if loop.time() >= deadline:
                raise TimeoutError
            self.counts["republished"] += 1

    def _refuse(self, env: env_pb.Envelope) -> SendOutcome | None:
        if env.origin.kind == env_pb.ORIGIN_KIND_IOA:
            return SendOutcome(env.message_id, env.recipient, NOT_PERMITTED,
                               detail="a message that came from IOA is never sent back into IOA")
        if env.hop_count + 1 > self._max_hops:
            return SendOutcome(env.message_id, env.recipient, NOT_PERMITTED,
                               detail=f"hop_count {env.hop_count} reached the limit of {self._max_hops}")
        return None

    def _may_return(self, node: str) -> bool:
        """Whether a node the network says it does not know is rather one not connected yet (KNOWN_NODES)."""
        return node in self._known_nodes

    def _heard_from(self, node: str) -> None:
        if len(self._known_nodes) < KNOWN_NODES:
            self._known_nodes.add(node)

    @staticmethod
    def _outcome_of(env: env_pb.Envelope, receipt: dict) -> SendOutcome:
        status = _RECEIPT_STATUS.get(receipt.get("status", ""), inbox_pb2.RECEIPT_STATUS_UNSPECIFIED)
        return SendOutcome(env.message_id, env.recipient, status, int(receipt.get("sequence", 0)),
                           int(receipt.get("stored_at_us", 0)), str(receipt.get("detail", ""))[:1000])

    async def _record_outbound(self, sender_id: str, envelopes: list[env_pb.Envelope],
                               outcomes: list[SendOutcome]) -> None:
        at = now_us()
        events = []
        for env, outcome in zip(envelopes, outcomes):
            status = RECEIPT_NAME[outcome.status]
            events.append(ev.Event(
                kind=ev.EVENT_KIND_MESSAGE_SENT, at_us=at, agent_id=env.recipient, message_id=env.message_id,
                sender=sender_id, recipient=env.recipient, sequence=outcome.sequence, detail=f"{status} (via IOA)",
                trace_id=trace_id_of(env.trace.traceparent), in_reply_to=env.in_reply_to,
                conversation_id=env.conversation_id))
        await self._events.record_events(events, lazy=False)

    # -- inbound ------------------------------------------------------------
    async def _arrived(self, message: net.IoaMessage) -> None:
        self._heard_from(getattr(message, "from").node)
        if message.media_type == RECEIPTS_MEDIA_TYPE:
            self._receipts_arrived(message)
            return
        if message.WhichOneof("to") == "space":
            self.counts["space"] += 1  # spaces are read explicitly (SpaceRead), not pushed into inboxes
            return
        if message.direct.node != self.node_id:
            log.warning("relay %s got a message for node %s; ignored", self.node_id, message.direct.node)
            return
        await self._inbound.put(message)

    def _receipts_arrived(self, message: net.IoaMessage) -> None:
        """Resolve the sends waiting for these receipts; a receipt counts
        only from the node the message went to, for its attempt, and in the
        receipts' format."""
        node = getattr(message, "from").node
        try:
            receipts = json.loads(message.data)
            waiting = [(self._receipts.get((r["for"], r.get("attempt", ""))), r) for r in receipts]
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):  # (nested too deep)
            waiting = None
        for entry, receipt in waiting or ():
            if entry is None or entry[0] != node or entry[1].done():
                continue
            if isinstance(receipt.get("status"), str) and receipt["status"] in _RECEIPT_STATUS and all(
                    type(receipt.get(f, 0)) is int for f in ("sequence", "stored_at_us")):
                entry[1].set_result(receipt)
            else:
                waiting = None
        if waiting is None:
            log.warning("relay %s got receipts it cannot read from node %s; ignored", self.node_id, node)

    async def _store_inbound(self) -> None:
        while True:
            try:  # while messages are held, look for those whose wait is over every SWEEP_S
                first = await (asyncio.wait_for(self._inbound.get(), SWEEP_S) if self._held else self._inbound.get())
            except TimeoutError:
                first = None
            batch = [] if first is None else [first]
            while not self._inbound.empty() and len(batch) < 256:
                batch.append(self._inbound.get_nowait())
            try:
                await self._take(batch)
            except Exception:  # a failure must not end inbound delivery; the senders publish again
                log.exception("relay %s could not store %d inbound messages", self.node_id, len(batch))

    async def _take(self, batch: list[net.IoaMessage]) -> None:
        """Store what arrived, in per-pair order: a message whose predecessor (AFTER) is not answered yet is
        held; once it is, the message is stored, and so on down the chain. A held message whose wait is
        over is stored without it (IOA_GAP)."""
        ready = await self._in_pair_order(batch)
        overdue = self._overdue()
        if overdue:
            self.counts["gaps"] += len(overdue)
            at = now_us()
            await self._events.record_events([ev.Event(
                kind=ev.EVENT_KIND_IOA_GAP, at_us=at, agent_id=a.message.direct.agent,
                message_id=a.message.ioa_message_id, sender=a.key[0], recipient=a.message.direct.agent,
                trace_id=trace_id(a.span), detail=(f"stored without {a.after[1] if a.after else ''}: not answered"
                                                   f" within {self.config.resequence_wait_s:g}s"))
                for a in overdue], lazy=False)
        ready += overdue
        while ready:
            await self._store_batch(ready)
            ready = [self._held.pop(key) for arrival in ready for key in self._waiting.pop(arrival.key, ())
                     if key in self._held]

    async def _in_pair_order(self, batch: list[net.IoaMessage]) -> list[_Arrival]:
        """The arrivals that may be stored now, in the order they came; the others held (IOA_HELD), or, past
        the hold's limit, neither stored nor answered (their senders publish them again)."""
        ready: list[_Arrival] = []
        taken: set[tuple[str, str]] = set()
        events: list[ev.Event] = []
        at = now_us()
        for message in batch:
            sender = getattr(message, "from")
            key = (address_of(sender.node, sender.agent), message.ioa_message_id)
            span = tracer.start_span("ioa.receive", context=context_of_headers(message.headers), attributes={
                "inboxmesh.ioa.message_id": message.ioa_message_id, "inboxmesh.ioa.from": sender.node})
            arrival = _Arrival(message, key, message.headers.get(H + "attempt", ""), span)
            events.append(ev.Event(kind=ev.EVENT_KIND_IOA_RECEIVED, at_us=at, agent_id=message.direct.agent,
                                   message_id=message.ioa_message_id, sender=key[0], recipient=message.direct.agent,
                                   trace_id=trace_id(span), detail=f"from node {sender.node}"))
            after = message.headers.get(AFTER, "")
            predecessor = (key[0], after)
            waits = bool(after) and len(after) <= MEMORY_KEY_CHARS and key not in self._handled and \
                predecessor not in taken and predecessor not in self._handled
            if waits:  # not answered here lately (or this relay restarted since): the store may have it
                waits = await self._stored(*predecessor) is None
            if not waits:
                ready.append(arrival)
                taken.add(key)
                continue
            if key in self._held:  # a copy of a message held already: the held one is answered in time
                self.counts["duplicates"] += 1
                span.end()
                events.append(ev.Event(kind=ev.EVENT_KIND_IOA_DUPLICATE, at_us=at, agent_id=message.direct.agent,
                                       message_id=message.ioa_message_id, sender=key[0],
                                       recipient=message.direct.agent, detail="a copy of a held message"))
                continue
            span.set_attribute("inboxmesh.ioa.after", after[:MEMORY_KEY_CHARS])
            if len(self._held) >= self.config.hold_limit:
                self.counts["hold_full"] += 1
                span.set_attribute("inboxmesh.receipt", "not answered: the hold is full")
                span.end()
                events.append(ev.Event(kind=ev.EVENT_KIND_IOA_GAP, at_us=at, agent_id=message.direct.agent,
                                       message_id=message.ioa_message_id, sender=key[0],
                                       recipient=message.direct.agent, detail=(
                                           f"the hold is full ({self.config.hold_limit} messages): neither stored"
                                           " nor answered now; its sender publishes it again")))
                continue
            arrival.after, arrival.since = predecessor, asyncio.get_running_loop().time()
            self._held[key] = arrival
            self._waiting.setdefault(predecessor, []).append(key)
            self.counts["held"] += 1
            events.append(ev.Event(kind=ev.EVENT_KIND_IOA_HELD, at_us=at, agent_id=message.direct.agent,
                                   message_id=message.ioa_message_id, sender=key[0], recipient=message.direct.agent,
                                   trace_id=trace_id(span), detail=f"waits for {after}"))
        await self._events.record_events(events)
        return ready

    def _overdue(self) -> list[_Arrival]:
        """Held messages whose resequence wait is over: stored without their predecessors (IOA_GAP)."""
        limit = asyncio.get_running_loop().time() - self.config.resequence_wait_s
        overdue: list[_Arrival] = []
        while self._held:
            arrival = next(iter(self._held.values()))
            if arrival.since > limit:
                break
            del self._held[arrival.key]
            assert arrival.after is not None
            waiting = self._waiting.get(arrival.after, [])
            if arrival.key in waiting:
                waiting.remove(arrival.key)
            if not waiting:
                self._waiting.pop(arrival.after, None)
            overdue.append(arrival)
        return overdue

    async def _store_batch(self, batch: list[_Arrival]) -> None:
        """Store a batch of inbound messages and answer their senders. A
        copy of an attempt this relay answered before gets that answer again
        without being stored; a message whose headers are over their bounds
        is refused (NOT_PERMITTED) without being stored."""
        keys = [arrival.key for arrival in batch]
        attempts = [arrival.attempt for arrival in batch]
        spans = [arrival.span for arrival in batch]
        messages = [arrival.message for arrival in batch]
        outcomes: list[SendOutcome | None] = [None] * len(batch)
        copies = [False] * len(batch)
        refused: list[int] = []
        storing: list[tuple[int, env_pb.Envelope]] = []
        for index, message in enumerate(messages):
            known = self._answered_before(keys[index], attempts[index])
            if known is not None:
                outcomes[index], copies[index] = known, True
                continue
            try:
                storing.append((index, to_envelope(message, node=self.node_id, max_hops=self._max_hops,
                                                   span=spans[index])))
            except (Refused, trails.TrailRefused) as exc:
                outcomes[index] = SendOutcome(message.ioa_message_id, message.direct.agent, NOT_PERMITTED,
                                              detail=str(exc))
                refused.append(index)
        at = now_us()
        if storing:
            delivered = await self._deliver_inbound([env for _, env in storing])
            for (index, _), outcome in zip(storing, delivered):
                outcomes[index] = outcome
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(batch), "every message was answered before, refused or stored"
        events = [ev.Event(kind=ev.EVENT_KIND_MESSAGE_SENT, at_us=at, agent_id=done[i].recipient,
                           message_id=done[i].message_id, sender=keys[i][0], recipient=done[i].recipient,
                           detail="not_permitted") for i in refused]
        answers: dict[str, list[dict]] = collections.defaultdict(list)
        for index, (message, span) in enumerate(zip(messages, spans)):
            outcome, key, attempt = done[index], keys[index], attempts[index]
            if not copies[index] and outcome.status == DUPLICATE:
                known = self._answered_before(key, attempt)  # an earlier copy in this same batch
                if known is not None:
                    outcome, copies[index] = known, True
            elif not copies[index] and attempt:
                self._remember(key, attempt, outcome)
            self._handled[key] = None
            self._handled.move_to_end(key)
            self.counts["received"] += 1
            span.set_attribute("inboxmesh.receipt", RECEIPT_ENUM_NAME[outcome.status])
            span.end()
            if copies[index] or outcome.status == DUPLICATE:
                self.counts["duplicates"] += 1
                status = RECEIPT_NAME[outcome.status]
                events.append(ev.Event(
                    kind=ev.EVENT_KIND_IOA_DUPLICATE, at_us=now_us(), agent_id=outcome.recipient,
                    message_id=message.ioa_message_id, sender=key[0], recipient=outcome.recipient,
                    sequence=outcome.sequence, detail="recognised, not stored again" if not copies[index] else
                    f"a copy of an attempt answered {status}; answered the same, not stored again"))
            if H + "relay" in message.headers:  # an inboxmesh relay waits for the receipt
                answers[getattr(message, "from").node].append({
                    "for": message.ioa_message_id, "attempt": attempt,
                    "status": RECEIPT_NAME[outcome.status],
                    "sequence": outcome.sequence, "stored_at_us": outcome.stored_at_us, "detail": outcome.detail})
        while len(self._handled) > RECEIPT_MEMORY:
            self._handled.popitem(last=False)
        if events:
            await self._events.record_events(events)
        for node, receipts in answers.items():
            await self._answer(node, receipts)

    def _answered_before(self, key: tuple[str, str], attempt: str) -> SendOutcome | None:
        known = self._answered.get(key)
        return known[1] if known is not None and attempt and known[0] == attempt else None

    def _remember(self, key: tuple[str, str], attempt: str, outcome: SendOutcome) -> None:
        if len(key[0]) + len(key[1]) + len(attempt) > MEMORY_KEY_CHARS:
            return  # not an inboxmesh relay's: its copies are left to the store
        self._answered[key] = (attempt, SendOutcome(outcome.message_id, outcome.recipient, outcome.status,
                                                    outcome.sequence, outcome.stored_at_us, outcome.detail))
        self._answered.move_to_end(key)
        while len(self._answered) > RECEIPT_MEMORY:
            self._answered.popitem(last=False)

    async def _answer(self, node: str, receipts: list[dict]) -> None:
        """Tell a sending relay what happened to its messages: the receipts
        its senders get (one IOA message for a batch). Written without
        waiting for the network's result (a receipt that is lost on the way
        is asked for again: the sender publishes the attempt again); kept
        for later while this relay is not connected."""
        message = from_address(net.IoaMessage(
            ioa_message_id=f"receipts:{self.node_id}:{uuid.uuid4().hex}",
            direct=net.Address(node=node, agent=RELAY_AGENT), media_type=RECEIPTS_MEDIA_TYPE,
            data=json.dumps(receipts).encode()), self.node_id, RELAY_AGENT)
        try:
            await self._publish_unanswered(message)
        except errors.Unavailable:
            self._parked.append(message)
            log.info("relay %s is not connected: %d receipts for %s wait for the connection", self.node_id,
                     len(receipts), node)

    async def _send_parked(self) -> None:
        while self._parked:
            message = self._parked.popleft()
            try:
                await self._publish_unanswered(message)
            except errors.Unavailable:
                self._parked.appendleft(message)
                return

    # -- spaces ---------------------------------------------------------------
    async def space_send(self, agent_id: str, space: str, text: str) -> net.PublishResult:
        if space not in self.spaces:
            self.spaces.add(space)  # joined on every (re)connect from now on
            async with self._write_lock:
                if self._call is not None:
                    try:
                        await self._call.write(net.NodeFrame(join=net.JoinSpace(space=space)))
                    except CALL_ENDED as exc:
                        if own_cancel(exc):
                            raise
                        # the connection is ending; the next one joins
        message = net.IoaMessage(ioa_message_id=f"{self.node_id}:{agent_id}:space:{uuid.uuid4().hex}", space=space,
                                 text=text, headers={H + "relay": f"{self.node_id}/{self.relay_id}"})
        return await self._publish(from_address(message, self.node_id, agent_id))

    async def space_read(self, space: str, after_seq: int, limit: int) -> list[net.IoaMessage]:
        try:
            response = await self._network.ReadSpace(
                net.ReadSpaceRequest(space=space, after_seq=after_seq, limit=limit), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise errors.Unavailable(f"could not read space {errors.clip(space)!r}:"
                                     f" {errors.clip(exc.details() or '', 200)}",
                                     reason=Reason.IOA_SPACE_UNREADABLE) from None
        return list(response.messages)
