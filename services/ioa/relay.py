"""The IOA relay: a mesh's one connection to an IOA network.

Addresses (docs/ioa.md): a local agent X of a mesh whose relay node is N is
`ioa:N/X` to the world; an IOA peer (node R, agent Y) is `ioa:R/Y` to local
agents, in the sender and recipient fields of ordinary envelopes.

Outbound: a send to `ioa:R/Y` is published through this relay's connection
with the sender's real identity (N, X) and the envelope's fields in
headers. The relay of node R stores it in Y's inbox by the ordinary Send
path and answers with that Send's receipt, which becomes the sender's
receipt here: unknown targets, closed agents, full inboxes look exactly as
they do locally.

Inbound: a message addressed to (N, X) is stored in X's inbox through
InboxService, as sender `ioa:<from>` with origin IOA; its message id is the
IOA message id, so a message the network delivers again after a reconnect
comes back DUPLICATE and is never consumed twice. Nothing is filtered by
node id: a message from a sibling on this same node is delivered like any
other. A message that came from IOA is never published again, and hop
counts stop loops between relays.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import random
import uuid

import grpc
from opentelemetry import trace

from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2
from inboxmesh.ioa.v1 import network_pb2 as net
from inboxmesh.ioa.v1 import network_pb2_grpc
from services import errors
from services.clock import now_us
from services.config import IoaConfig
from services.store.base import IOA_PREFIX, NOT_PERMITTED, UNKNOWN_TARGET, SendOutcome, Store
from services.telemetry import context_of, inject, trace_id_of, tracer

log = logging.getLogger(__name__)
PREFIX = IOA_PREFIX
RELAY_AGENT = "inboxmesh-relay"
"""The agent name relays use to talk to each other (receipts)."""
RECEIPTS_MEDIA_TYPE = "application/vnd.inboxmesh.receipts+json"
"""A relay's answer to another relay: [{for, status, sequence, stored_at_us, detail}, ...]."""
H = "inboxmesh-"
_RECEIPT_STATUS = {inbox_pb2.ReceiptStatus.Name(v).removeprefix("RECEIPT_STATUS_").lower(): v
                   for v in inbox_pb2.ReceiptStatus.values()}


def address_of(node: str, agent: str) -> str:
    return f"{PREFIX}{node}/{agent}"


def parse_address(address: str) -> tuple[str, str]:
    """(node, agent) of an `ioa:<node>/<agent>` address."""
    node, slash, agent = address.removeprefix(PREFIX).partition("/")
    if not address.startswith(PREFIX) or not slash or not node or not agent:
        raise errors.InvalidArgument(f"{address!r} is not an IOA address; expected 'ioa:<node>/<agent>'",
                                     reason="BAD_IOA_ADDRESS")
    return node, agent


class IoaRelay:
    def __init__(self, config: IoaConfig, store: Store, max_hops: int):
        self.config = config
        self.node_id = config.node_id
        self.relay_id = uuid.uuid4().hex[:12]
        self._store = store
        self._max_hops = max_hops
        self.inbox = None  # set by the mesh: services.inbox.service.InboxService
        self.connected = asyncio.Event()
        self.reconnects = 0
        self.counts = collections.Counter()
        self.spaces: set[str] = set()
        self._call = None
        self._write_lock = asyncio.Lock()
        self._publish_ids = itertools.count(1)
        self._published: dict[int, asyncio.Future] = {}
        self._receipts: dict[str, asyncio.Future] = {}
        self._inbound: asyncio.Queue = asyncio.Queue(maxsize=config.inbound_queue)
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # -- lifecycle ----------------------------------------------------------
    async def start(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.config.network)
        self._network = network_pb2_grpc.IoaNetworkStub(self._channel)
        self._tasks = [asyncio.create_task(self._connection(), name="ioa-connection"),
                       asyncio.create_task(self._store_inbound(), name="ioa-inbound")]

    async def stop(self) -> None:
        self._stopping = True
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._channel.close()

    async def wait_connected(self, timeout: float) -> None:
        await asyncio.wait_for(self.connected.wait(), timeout)

    async def _connection(self) -> None:
        failures = 0
        while not self._stopping:
            call = self._network.Connect()
            self._call = call
            try:
                await call.write(net.NodeFrame(hello=net.Hello(node_id=self.node_id)))
                for space in sorted(self.spaces):
                    await call.write(net.NodeFrame(join=net.JoinSpace(space=space)))
                async for frame in call:
                    which = frame.WhichOneof("frame")
                    if which == "welcome":
                        failures = 0
                        self.connected.set()
                        log.info("relay %s connected to %s (%d recent messages come again)", self.node_id,
                                 self.config.network, frame.welcome.redelivering)
                    elif which == "result":
                        future = self._published.pop(frame.result.publish_id, None)
                        if future is not None and not future.done():
                            future.set_result(frame.result)
                    elif which == "message":
                        await self._arrived(frame.message)
            except grpc.aio.AioRpcError as exc:
                if self._stopping:
                    return
                log.warning("relay %s lost the IOA network: %s", self.node_id, exc.details())
            finally:
                self.connected.clear()
                self._call = None
                call.cancel()
                for future in self._published.values():
                    if not future.done():
                        future.set_exception(errors.Unavailable("the IOA connection was lost"))
                self._published.clear()
            if self._stopping:
                return
            failures += 1
            self.reconnects += 1
            await asyncio.sleep(min(2.0, 0.05 * 2 ** min(failures, 6)) * (0.5 + random.random() / 2))

    async def _publish(self, message: net.IoaMessage) -> net.PublishResult:
        if not self.connected.is_set() or self._call is None:
            raise errors.Unavailable(f"relay {self.node_id} is not connected to the IOA network; nothing was sent",
                                     reason="IOA_DISCONNECTED")
        publish_id = next(self._publish_ids)
        future = asyncio.get_running_loop().create_future()
        self._published[publish_id] = future
        try:
            async with self._write_lock:
                await self._call.write(net.NodeFrame(publish=net.Publish(message=message, publish_id=publish_id)))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, AttributeError) as exc:
            self._published.pop(publish_id, None)
            raise errors.Unavailable(f"could not publish to the IOA network: {exc}", reason="IOA_DISCONNECTED") from None
        return await asyncio.wait_for(future, self.config.receipt_timeout_s)

    # -- outbound -----------------------------------------------------------
    async def forward(self, sender_id: str, envelopes: list[env_pb.Envelope]) -> list[SendOutcome]:
        """Publish local agents' messages to IOA addresses, in order (one
        stream, so the network keeps the order), without waiting for each
        before the next; return the receiving meshes' receipts."""
        outcomes: list[SendOutcome | None] = [None] * len(envelopes)
        pending: list[tuple[int, str, net.IoaMessage, asyncio.Future, trace.Span]] = []
        for index, env in enumerate(envelopes):
            refused = self._refuse(env)
            if refused is not None:
                outcomes[index] = refused
                continue
            node, agent = parse_address(env.recipient)
            ioa_id = f"{self.node_id}:{sender_id}:{env.message_id}"
            span = tracer.start_span("ioa.publish", context=context_of(env),
                                     attributes={"inboxmesh.ioa.message_id": ioa_id, "inboxmesh.ioa.to": node})
            future = asyncio.get_running_loop().create_future()
            self._receipts[ioa_id] = future
            pending.append((index, ioa_id, self._outbound(env, sender_id, ioa_id, node, agent, span), future, span))
        await self._store.record_events([ev.Event(
            kind=ev.EVENT_KIND_IOA_PUBLISHED, at_us=now_us(), agent_id=envelopes[i].recipient,
            message_id=envelopes[i].message_id, sender=sender_id, recipient=envelopes[i].recipient, detail=ioa_id,
            trace_id=trace_id_of(envelopes[i].trace.traceparent), in_reply_to=envelopes[i].in_reply_to,
            conversation_id=envelopes[i].conversation_id) for i, ioa_id, *_ in pending])  # handed to the network
        try:
            results = await asyncio.gather(*(self._publish(message) for _, _, message, _, _ in pending))
            for (index, ioa_id, _, future, span), result in zip(pending, results):
                env = envelopes[index]
                if result.status == net.PUBLISH_STATUS_UNKNOWN_NODE:
                    outcomes[index] = SendOutcome(env.message_id, env.recipient, UNKNOWN_TARGET,
                                                  detail=f"no IOA node {env.recipient.removeprefix(PREFIX).split('/')[0]!r}")
                elif result.status != net.PUBLISH_STATUS_OK:
                    raise errors.Unavailable(f"the IOA network did not take the message for {env.recipient}:"
                                             f" {result.detail}; nothing was delivered, retry with the same"
                                             " message_id", reason="IOA_" + net.PublishStatus.Name(result.status))
                else:
                    self.counts["forwarded"] += 1
            for index, ioa_id, _, future, span in pending:
                if outcomes[index] is None:
                    outcomes[index] = self._outcome_of(envelopes[index], await asyncio.wait_for(
                        future, self.config.receipt_timeout_s))
        except TimeoutError:
            raise errors.Unavailable(
                f"no receipt from the IOA network within {self.config.receipt_timeout_s:.0f}s; the message may or"
                " may not have arrived: retry with the same message_id (duplicates are recognised)",
                reason="IOA_NO_RECEIPT") from None
        finally:
            for _, ioa_id, _, _, span in pending:
                self._receipts.pop(ioa_id, None)
                span.end()
        await self._record_outbound(sender_id, envelopes, outcomes)
        return outcomes

    def _refuse(self, env: env_pb.Envelope) -> SendOutcome | None:
        if env.origin.kind == env_pb.ORIGIN_KIND_IOA:
            return SendOutcome(env.message_id, env.recipient, NOT_PERMITTED,
                               detail="a message that came from IOA is never sent back into IOA")
        if env.hop_count + 1 > self._max_hops:
            return SendOutcome(env.message_id, env.recipient, NOT_PERMITTED,
                               detail=f"hop_count {env.hop_count} reached the limit of {self._max_hops}")
        return None

    def _outbound(self, env: env_pb.Envelope, sender_id: str, ioa_id: str, node: str, agent: str,
                  span: trace.Span) -> net.IoaMessage:
        headers = dict(env.headers)
        headers.update({
            H + "relay": f"{self.node_id}/{self.relay_id}",
            H + "kind": env_pb.MessageKind.Name(env.kind or env_pb.MESSAGE_KIND_TEXT),
            H + "message-id": env.message_id,
            H + "hops": str(env.hop_count + 1),
        })
        for field in ("in_reply_to", "conversation_id"):
            if getattr(env, field):
                headers[H + field.replace("_", "-")] = getattr(env, field)
        if env.expires_at_us:
            headers[H + "expires-at-us"] = str(env.expires_at_us)
        carrier = env_pb.Envelope()
        inject(carrier, trace.set_span_in_context(span))
        if carrier.trace.traceparent:
            headers["traceparent"] = carrier.trace.traceparent
        return net.IoaMessage(
            ioa_message_id=ioa_id, direct=net.Address(node=node, agent=agent), text=env.content.text,
            data=env.content.data, media_type=env.content.media_type, headers=headers,
            **{"from": net.Address(node=self.node_id, agent=sender_id)})

    @staticmethod
    def _outcome_of(env: env_pb.Envelope, receipt: dict) -> SendOutcome:
        status = _RECEIPT_STATUS.get(receipt.get("status", ""), inbox_pb2.RECEIPT_STATUS_UNSPECIFIED)
        return SendOutcome(env.message_id, env.recipient, status, int(receipt.get("sequence", 0)),
                           int(receipt.get("stored_at_us", 0)), receipt.get("detail", ""))

    async def _record_outbound(self, sender_id: str, envelopes, outcomes) -> None:
        at = now_us()
        events = []
        for env, outcome in zip(envelopes, outcomes):
            status = inbox_pb2.ReceiptStatus.Name(outcome.status).removeprefix("RECEIPT_STATUS_").lower()
            events.append(ev.Event(
                kind=ev.EVENT_KIND_MESSAGE_SENT, at_us=at, agent_id=env.recipient, message_id=env.message_id,
                sender=sender_id, recipient=env.recipient, sequence=outcome.sequence, detail=f"{status} (via IOA)",
                trace_id=trace_id_of(env.trace.traceparent), in_reply_to=env.in_reply_to,
                conversation_id=env.conversation_id))
        await self._store.record_events(events, lazy=False)

    # -- inbound ------------------------------------------------------------
    async def _arrived(self, message: net.IoaMessage) -> None:
        if message.media_type == RECEIPTS_MEDIA_TYPE:
            for receipt in json.loads(message.data):
                future = self._receipts.get(receipt["for"])
                if future is not None and not future.done():
                    future.set_result(receipt)
            return
        if message.WhichOneof("to") == "space":
            self.counts["space"] += 1  # spaces are read explicitly (SpaceRead), not pushed into inboxes
            return
        if message.direct.node != self.node_id:
            log.warning("relay %s got a message for node %s; ignored", self.node_id, message.direct.node)
            return
        await self._inbound.put(message)

    async def _store_inbound(self) -> None:
        while True:
            batch = [await self._inbound.get()]
            while not self._inbound.empty() and len(batch) < 256:
                batch.append(self._inbound.get_nowait())
            try:
                await self._store_batch(batch)
            except Exception:  # a failure must not end inbound delivery; the network redelivers on reconnect
                log.exception("relay %s could not store %d inbound messages", self.node_id, len(batch))

    async def _store_batch(self, batch: list[net.IoaMessage]) -> None:
        envelopes, spans = [], []
        for message in batch:
            sender = getattr(message, "from")
            span = tracer.start_span("ioa.receive", context=_context_of_headers(message.headers), attributes={
                "inboxmesh.ioa.message_id": message.ioa_message_id, "inboxmesh.ioa.from": sender.node})
            spans.append(span)
            envelopes.append(self._envelope(message, span))
        at = now_us()
        await self._store.record_events([ev.Event(
            kind=ev.EVENT_KIND_IOA_RECEIVED, at_us=at, agent_id=e.recipient, message_id=e.message_id,
            sender=e.sender, recipient=e.recipient, trace_id=trace_id_of(e.trace.traceparent),
            detail=f"from node {e.origin.ioa_node}") for e in envelopes], lazy=False)
        outcomes = await self.inbox.deliver_from_ioa(envelopes)
        duplicates = []
        answers: dict[str, list[dict]] = collections.defaultdict(list)
        for message, outcome, span in zip(batch, outcomes, spans):
            self.counts["received"] += 1
            span.set_attribute("inboxmesh.receipt", inbox_pb2.ReceiptStatus.Name(outcome.status))
            span.end()
            sender = getattr(message, "from")
            if outcome.status == inbox_pb2.RECEIPT_STATUS_DUPLICATE:
                self.counts["duplicates"] += 1
                duplicates.append(ev.Event(
                    kind=ev.EVENT_KIND_IOA_DUPLICATE, at_us=now_us(), agent_id=outcome.recipient,
                    message_id=message.ioa_message_id, sender=address_of(sender.node, sender.agent),
                    recipient=outcome.recipient, sequence=outcome.sequence, detail="recognised, not stored again"))
            if H + "relay" in message.headers:  # an inboxmesh relay waits for the receipt
                answers[sender.node].append({
                    "for": message.ioa_message_id,
                    "status": inbox_pb2.ReceiptStatus.Name(outcome.status).removeprefix("RECEIPT_STATUS_").lower(),
                    "sequence": outcome.sequence, "stored_at_us": outcome.stored_at_us, "detail": outcome.detail})
        if duplicates:
            await self._store.record_events(duplicates)
        await asyncio.gather(*(self._answer(node, receipts) for node, receipts in answers.items()))

    def _envelope(self, message: net.IoaMessage, span: trace.Span) -> env_pb.Envelope:
        h = message.headers
        sender = getattr(message, "from")
        kind = h.get(H + "kind", "MESSAGE_KIND_TEXT")
        env = env_pb.Envelope(
            message_id=message.ioa_message_id,
            sender=address_of(sender.node, sender.agent),
            recipient=message.direct.agent,
            kind=env_pb.MessageKind.Value(kind) if kind in env_pb.MessageKind.keys() else env_pb.MESSAGE_KIND_TEXT,
            content=env_pb.Content(text=message.text, data=message.data, media_type=message.media_type),
            in_reply_to=self._local_id(h.get(H + "in-reply-to", "")),
            conversation_id=h.get(H + "conversation-id", ""),
            origin=env_pb.Origin(kind=env_pb.ORIGIN_KIND_IOA, ioa_node=sender.node,
                                 ioa_message_id=message.ioa_message_id),
            hop_count=int(h.get(H + "hops", "1") or 1),
            expires_at_us=int(h.get(H + "expires-at-us", "0") or 0),
            headers={k: v for k, v in h.items() if not k.startswith(H) and k != "traceparent"},
            created_at_us=message.sent_at_us,
        )
        inject(env, trace.set_span_in_context(span))
        return env

    def _local_id(self, ioa_id: str) -> str:
        """An IOA id this node minted for one of its own messages is answered
        with the original message id (correlation is kept both ways)."""
        node, _, rest = ioa_id.partition(":")
        if node == self.node_id and rest:
            return rest.partition(":")[2] or ioa_id
        return ioa_id

    async def _answer(self, node: str, receipts: list[dict]) -> None:
        """Tell a sending relay what happened to its messages: the receipts
        its senders get (one IOA message for a batch)."""
        message = net.IoaMessage(
            ioa_message_id=f"receipts:{self.node_id}:{uuid.uuid4().hex}",
            direct=net.Address(node=node, agent=RELAY_AGENT), media_type=RECEIPTS_MEDIA_TYPE,
            data=json.dumps(receipts).encode(), **{"from": net.Address(node=self.node_id, agent=RELAY_AGENT)})
        try:
            await self._publish(message)
        except (errors.MeshError, TimeoutError) as exc:
            log.warning("relay %s could not answer %d messages from %s: %s", self.node_id, len(receipts), node, exc)

    # -- spaces ---------------------------------------------------------------
    async def space_send(self, agent_id: str, space: str, text: str) -> net.PublishResult:
        if space not in self.spaces:
            self.spaces.add(space)
            if self._call is not None:
                async with self._write_lock:
                    await self._call.write(net.NodeFrame(join=net.JoinSpace(space=space)))
        message = net.IoaMessage(ioa_message_id=f"{self.node_id}:{agent_id}:space:{uuid.uuid4().hex}", space=space,
                                 text=text, headers={H + "relay": f"{self.node_id}/{self.relay_id}"},
                                 **{"from": net.Address(node=self.node_id, agent=agent_id)})
        return await self._publish(message)

    async def space_read(self, space: str, after_seq: int, limit: int) -> list[net.IoaMessage]:
        try:
            response = await self._network.ReadSpace(
                net.ReadSpaceRequest(space=space, after_seq=after_seq, limit=limit), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise errors.Unavailable(f"could not read space {space!r}: {exc.details()}") from None
        return list(response.messages)


def _context_of_headers(headers) -> object:
    if "traceparent" not in headers:
        return None
    return context_of(env_pb.Envelope(trace=env_pb.TraceContext(traceparent=headers["traceparent"])))
