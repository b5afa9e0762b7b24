"""Inbox rules: sending with receipts, acks, status and dead letters.
Knows nothing of gRPC; delivery streams live in services.inbox.delivery, the
storing of messages (also for the IOA relay and the routing ingress) in
services.inbox.writer."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from inboxmesh.client import errors
from inboxmesh.client.addressing import A2A_TO_HEADER
from inboxmesh.client.errors import Reason
from inboxmesh.client.tracing import context_of, tracer
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.events.v1 import events_pb2 as ev
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.clock import now_us
from services.config import InboxLimits
from services.directory import Caller, Directory
from services.faults import crash_point
from services.inbox.delivery import DeliveryHub, Subscription
from services.inbox.writer import InboxWriter
from services.store.base import (
    A2A_PREFIX,
    CHANNEL_PREFIX,
    IOA_PREFIX,
    NOT_PERMITTED,
    RESERVED_ID_PREFIX,
    UNKNOWN_TARGET,
    AckOutcome,
    AgentRecord,
    AppendItem,
    EventStore,
    Frontier,
    InboxStore,
    MessageRecord,
    SendOutcome,
)
from services.validation import check_text, fitting, page_size, stored_int

log = logging.getLogger(__name__)
_LOCAL = envelope_pb2.Origin(kind=envelope_pb2.ORIGIN_KIND_LOCAL)
_MESSAGE_KINDS = frozenset(envelope_pb2.MessageKind.values())
_FRONTIERS_KEPT = 4096
"""Frontiers kept in memory; older ones are read from the store again when their agent sends."""

_STREAM_SENDERS = 100_000
"""Senders one SendStream may hold proven credentials of (RESOURCE_EXHAUSTED / STREAM_FULL beyond)."""

class IoaForwarding(Protocol):
    """Messages the IOA relay published (services.ioa.relay.Forwarding)."""

    async def outcomes(self) -> list[SendOutcome]:
        """Their receipts, in order, once the receiving meshes answered."""


ForwardToIoa = Callable[[str, list[envelope_pb2.Envelope], bool | None], Awaitable[IoaForwarding]]
"""(sender agent id, messages to IOA addresses, whether the outbox keeps what cannot reach its node (None: as
the relay is configured)) -> what waits for their receipts, once their first copies are written, in the
order of the calls: the IOA relay's start_forward."""
ChannelGateway = Callable[[str, str], Awaitable[AgentRecord]]
"""(channel, account) -> the channel account's gateway agent (services.routing.service.RoutingService.gateway)."""
A2aGateway = Callable[[], Awaitable[AgentRecord | None]]
"""The A2A gateway agent, None while no gateway claimed it (services.gateway.service)."""
CHANNEL_TO_HEADER = "inboxmesh-channel-to"
"""On a message stored in a channel gateway's inbox: the channel address it answers (docs/routing.md "Answers")."""
_OUTBOX_CHOICE: dict[int, bool | None] = {pb.IOA_DELIVERY_DEFAULT: None, pb.IOA_DELIVERY_DIRECT: False,
                                          pb.IOA_DELIVERY_OUTBOX: True}
"""SendRequest.ioa_delivery -> the outbox choice ForwardToIoa takes."""
Prove = Callable[[Sequence[str]], Awaitable[tuple[Caller, ...]]]
"""Credentials a call carries after its metadata or first request -> the callers they prove (or the
refusal): services.auth_policy's, the same directory path as the first request's."""


class StreamSenders:
    """The agents the requests of one Send call or SendStream may send as: the call's own caller, and every
    agent whose credential a request of the stream carried (proven once per credential per stream).
    Bounded: at most _STREAM_SENDERS agents."""

    def __init__(self, caller: Caller, prove: Prove):
        self._caller = caller
        self._prove = prove
        self._by_agent: dict[str, Caller] = {}
        self._proven: set[str] = set()
        """Credentials already proven on this stream (not proven again)."""

    def held(self, agent_id: str) -> Caller | None:
        """The caller of an agent this stream may send as (the call's own, or one whose credential a request
        carried), or None."""
        own = self._caller.agent
        if own is not None and own.agent_id == agent_id:
            return self._caller
        return self._by_agent.get(agent_id)

    def named_senders(self, requests: Sequence[pb.SendRequest]) -> list[str]:
        """The agents these requests' messages name as their senders (a message's `sender`, else its
        request's, else the call's own agent), once each, in order: proven or not (sender_of decides)."""
        own = self._caller.agent.agent_id if self._caller.agent is not None else ""
        named = (env.sender or request.sender or own for request in requests for env in request.messages)
        return [agent_id for agent_id in dict.fromkeys(named) if agent_id]

    async def sender_of(self, request: pb.SendRequest) -> Caller:
        """The caller a request sends as, after proving the credentials it carries."""
        fresh = [c for c in dict.fromkeys(request.credentials) if c not in self._proven]
        if fresh:
            callers = await self._prove(fresh)
            for credential, caller in zip(fresh, callers):
                agent = caller.require_agent("sending")
                if agent.agent_id not in self._by_agent and len(self._by_agent) >= _STREAM_SENDERS:
                    raise errors.ResourceExhausted(
                        f"this stream already holds the credentials of {len(self._by_agent)} senders, the most one"
                        " stream may; open another SendStream for more", reason=Reason.STREAM_FULL,
                        metadata={"limit": str(_STREAM_SENDERS)})
                self._by_agent[agent.agent_id] = caller
                self._proven.add(credential)
        if not request.sender:
            return self._caller
        own = self._caller.agent
        if own is not None and own.agent_id == request.sender:
            return self._caller
        named = self._by_agent.get(request.sender)
        if named is None:
            shown = errors.clip(request.sender)
            raise errors.PermissionDenied(
                f"the request names sender {shown!r}, whose credential this stream does not hold: put it in"
                " `credentials` of this or an earlier request of the stream (or send with that agent's own"
                " authorization metadata)", reason=Reason.SENDER_NOT_PROVEN, metadata={"sender": shown})
        return named


class InboxService:
    def __init__(self, store: InboxStore, events: EventStore, directory: Directory, limits: InboxLimits,
                 hub: DeliveryHub, writer: InboxWriter, forward_to_ioa: ForwardToIoa | None,
                 channel_gateway: ChannelGateway | None = None, a2a_gateway: A2aGateway | None = None):
        self._store = store
        self._events = events
        self._directory = directory
        self._limits = limits
        self.hub = hub
        """Subscriptions (the gRPC handler streams from it)."""
        self._writer = writer
        self._forward_to_ioa = forward_to_ioa
        """None: the mesh has no IOA relay, and a send to an IOA address is UNKNOWN_TARGET."""
        self._channel_gateway = channel_gateway
        """The gateway agent of a channel account (services.routing.service.RoutingService.gateway); None: the
        mesh routes no channels, and a send to a channel address is UNKNOWN_TARGET."""
        self._a2a_gateway = a2a_gateway
        """The A2A gateway agent: sends to `a2a:` addresses are stored in its inbox (UNKNOWN_TARGET without it)."""
        self._frontiers: collections.OrderedDict[str, Frontier | None] = collections.OrderedDict()
        """Recently used agents' Frontiers (loop guard), most recent last; bounded by _FRONTIERS_KEPT."""

    # -- send ---------------------------------------------------------------
    def _check_count(self, envelopes: list[envelope_pb2.Envelope]) -> None:
        if not envelopes:
            raise errors.InvalidArgument("the request holds no messages", reason=Reason.EMPTY_REQUEST)
        if len(envelopes) > self._limits.max_batch_messages:
            raise errors.InvalidArgument(
                f"{len(envelopes)} messages in one request; at most {self._limits.max_batch_messages}",
                reason=Reason.BATCH_TOO_LARGE,
            )

    def validate_external(self, prefix: str, envelopes: list[envelope_pb2.Envelope]) -> None:
        """A gateway's messages (GatewayService.deliver) checked as sends are, their senders addresses starting
        with `prefix` instead of the caller's id."""
        self._validate(prefix, envelopes, external=True)

    def _validate(self, sender_id: str, envelopes: list[envelope_pb2.Envelope], first_index: int = 0, *,
                  external: bool = False) -> None:
        limits = self._limits
        self._check_count(envelopes)
        for index, env in enumerate(envelopes, start=first_index):
            where = f"message {index} ({errors.clip(env.message_id) or 'no id'})"
            for field, value in (("message_id", env.message_id), ("recipient", env.recipient)):
                if not value:
                    raise errors.InvalidArgument(f"{where}: {field} is required", reason=Reason.MISSING_FIELD,
                                                 metadata={"index": str(index), "field": field})
            for field, value in (("message_id", env.message_id), ("recipient", env.recipient),
                                 ("conversation_id", env.conversation_id), ("in_reply_to", env.in_reply_to)):
                check_text(f"{where}: {field}", value, max_len=limits.max_id_length)
            if external and not env.sender.startswith(sender_id):
                raise errors.InvalidArgument(
                    f"{where}: a gateway delivers messages from addresses starting with {sender_id!r};"
                    f" sender {errors.clip(env.sender)!r} is not one", reason=Reason.BAD_GATEWAY_SENDER,
                    metadata={"index": str(index), "sender": errors.clip(env.sender)})
            if not external and env.sender and env.sender != sender_id:
                raise errors.PermissionDenied(
                    f"{where} names sender {env.sender} but the credential is {sender_id}'s:"
                    " an agent can only send as itself",
                    reason=Reason.SENDER_MISMATCH,
                    metadata={"index": str(index), "claimed_sender": env.sender, "sender": sender_id},
                )
            if env.message_id.startswith(RESERVED_ID_PREFIX):
                raise errors.InvalidArgument(f"{where}: message ids starting with {RESERVED_ID_PREFIX!r} are the"
                                             " mesh's own", reason=Reason.RESERVED_ID,
                                             metadata={"index": str(index), "field": "message_id"})
            if env.kind == envelope_pb2.MESSAGE_KIND_REPLY and not env.in_reply_to:
                raise errors.InvalidArgument(f"{where}: a REPLY needs in_reply_to", reason=Reason.MISSING_FIELD,
                                             metadata={"index": str(index), "field": "in_reply_to"})
            if env.kind not in _MESSAGE_KINDS:
                raise errors.InvalidArgument(f"{where}: unknown kind {env.kind}", reason=Reason.BAD_KIND)
            if env.origin.kind in (envelope_pb2.ORIGIN_KIND_IOA, envelope_pb2.ORIGIN_KIND_A2A) and not external:
                raise errors.PermissionDenied(f"{where}: only the IOA relay and the A2A gateway may send with"
                                              " their origins", reason=Reason.ORIGIN_NOT_ALLOWED)
            size = env.ByteSize()
            if size > limits.max_message_bytes:
                raise errors.InvalidArgument(
                    f"{where} is {size} bytes; the limit is {limits.max_message_bytes}",
                    reason=Reason.MESSAGE_TOO_LARGE,
                    metadata={"index": str(index), "size": str(size), "limit": str(limits.max_message_bytes)},
                )

    async def send(self, caller: Caller, envelopes: list[envelope_pb2.Envelope],
                   outbox: bool | None = None) -> list[SendOutcome]:
        """Store the messages in order (IOA recipients through the relay, `outbox` as ForwardToIoa takes
        it); one outcome each. Malformed input fails the whole call before anything is stored."""
        taken_at = time.monotonic()
        sender = await self._checked(caller, envelopes)
        if not any(e.recipient.startswith(IOA_PREFIX) for e in envelopes):
            return await self._send_local(caller, sender, envelopes, taken_at)
        return await self._send_via_ioa(caller, sender, envelopes, outbox, taken_at)

    async def send_requests(self, senders: StreamSenders, requests: Sequence[pb.SendRequest]
                            ) -> tuple[list[list[SendOutcome]], errors.MeshError | None]:
        """start_requests, then its answers."""
        finish, _ = await self.start_requests(senders, requests)
        return await finish()

    def all_to_ioa(self, requests: Sequence[pb.SendRequest]) -> bool:
        """Whether every message of these requests goes to an IOA address (and each has messages): then
        start_requests publishes them and leaves only their receipts to wait for, stores nothing here, and
        a SendStream may start its next requests meanwhile."""
        return self._forward_to_ioa is not None and all(
            r.messages and all(e.recipient.startswith(IOA_PREFIX) for e in r.messages) for r in requests)

    async def start_requests(self, senders: StreamSenders, requests: Sequence[pb.SendRequest]) -> tuple[
            Callable[[], Awaitable[tuple[list[list[SendOutcome]], errors.MeshError | None]]], bool]:
        """The requests of one Send call, or several of one SendStream read together: each checked in
        order as `send` checks one, the local ones stored together (InboxWriter.store in order: one commit
        on SQLite for requests that share no sender and no recipient) and answered in order. Stops at the
        first request refused: returns the outcomes of the requests before it and its refusal; nothing of
        it or of later requests is stored. A request that carries credentials and no messages has no
        outcomes.

        Requests whose messages all go to IOA recipients are published in order, each without waiting for
        the receipts of the one before (the relay writes their first copies in the order of the requests),
        and their receipts are waited for before anything after them is stored. When one of them fails
        (UNAVAILABLE, no receipt), the IOA requests after it were published too and may have been stored
        on the far side: the stream ends with the failure, and their retry (same message ids) reads
        DUPLICATE there.

        Returns, once every request was checked and what goes to IOA published, what finishes them: it
        waits for the receipts, stores what is left to store and gives (the outcomes of each request
        answered, the refusal that stopped them or None); and whether a request was refused already."""
        answered: list[list[SendOutcome]] = []
        unstored: list[list[list[AppendItem]]] = []
        """Items of the requests checked since the last store: per request, one list per sender's run of
        its messages."""
        forwarded: list[tuple[int, list[IoaForwarding]]] = []
        """Requests to IOA recipients only, published and waiting for their receipts: (their place in
        `answered`, what waits for the receipts of each sender's run)."""

        async def receipts() -> None:
            """The receipts of the requests published to IOA, in order, into their places. At the first
            failure, every one is still waited for (nothing is left waiting in the relay), the answers
            stop before the request that failed, and that failure is raised."""
            taken = forwarded[:]
            forwarded.clear()
            failed: errors.MeshError | None = None
            for position, runs in taken:
                for forwarding in runs:
                    try:
                        outcomes = await forwarding.outcomes()
                    except errors.MeshError as exc:
                        failed = failed or exc
                        if len(answered) > position:
                            del answered[position:]
                        continue
                    if failed is None:
                        answered[position] += outcomes
            if failed is not None:
                unstored.clear()  # requests after the one that failed: not stored
                raise failed

        async def store() -> None:
            await receipts()  # what comes after a request that failed is not stored
            taken = unstored[:]  # taken before the write: what fails is not written again
            unstored.clear()
            groups: list[list[AppendItem]] = []
            for parts in taken:
                for items in parts:  # a sender's consecutive runs (across requests too) are one append
                    if groups and items and groups[-1][0].envelope.sender == items[0].envelope.sender:
                        groups[-1] = groups[-1] + items
                    elif items:
                        groups.append(items)
            outcomes = iter(await self._writer.store(groups, now_us(), in_order=True) if groups else [])
            answered.extend([next(outcomes) for items in parts for _ in items] for parts in taken)

        failure: errors.MeshError | None = None
        taken_at = time.monotonic()  # the requests are here: a read of a sender begun since serves them
        try:
            frontiers = await self._frontiers_of(senders.named_senders(requests))
            for request in requests:
                caller = await senders.sender_of(request)
                envelopes = list(request.messages)
                if request.ioa_delivery not in _OUTBOX_CHOICE:
                    raise errors.InvalidArgument(f"unknown ioa_delivery {request.ioa_delivery}",
                                                 reason=Reason.BAD_VALUE, metadata={"field": "ioa_delivery"})
                outbox = _OUTBOX_CHOICE[request.ioa_delivery]
                if not envelopes and request.credentials:
                    unstored.append([])
                    continue
                parts = [(part_caller, await self._checked(part_caller, run, first_index, frontiers), run)
                         for part_caller, first_index, run in self._by_sender(senders, caller, envelopes)]
                if not any(e.recipient.startswith(IOA_PREFIX) for e in envelopes):
                    unstored.append([await self._local_items(part_caller, sender, run, taken_at)
                                     for part_caller, sender, run in parts])
                    continue
                if unstored:
                    await store()  # what came before is stored first: the order holds
                if self._forward_to_ioa is not None and all(e.recipient.startswith(IOA_PREFIX) for e in envelopes):
                    # published now, in order; its receipts waited for with the next requests' (pipelined)
                    answered.append([])
                    forwarded.append((len(answered) - 1, [await self._forward_to_ioa(sender.agent_id,
                                                                                      _outbound(sender, run), outbox)
                                                          for _, sender, run in parts]))
                    continue
                await receipts()
                outcomes: list[SendOutcome] = []
                for part_caller, sender, run in parts:
                    outcomes += await self._send_via_ioa(part_caller, sender, run, outbox, taken_at)
                answered.append(outcomes)
        except errors.MeshError as exc:
            failure = exc

        async def finish() -> tuple[list[list[SendOutcome]], errors.MeshError | None]:
            nonlocal failure
            try:
                await store()
            except errors.MeshError as exc:  # those requests (all before a refused one) are not answered: the
                failure = exc  # stream ends with this
            return answered, failure

        return finish, failure is not None

    def _by_sender(self, senders: StreamSenders, caller: Caller, envelopes: list[envelope_pb2.Envelope]
                   ) -> list[tuple[Caller, int, list[envelope_pb2.Envelope]]]:
        """A request's messages as runs of one sender each: (its caller, the index of the run's first message,
        the run). A message's `sender` may name any agent the stream holds the credential of; empty is the
        request's sender. Naming another is SENDER_MISMATCH, and nothing of the request is stored."""
        own = caller.require_agent("sending").agent_id
        self._check_count(envelopes)
        runs: list[tuple[Caller, int, list[envelope_pb2.Envelope]]] = []
        for index, env in enumerate(envelopes):
            named = env.sender or own
            if runs and (runs[-1][2][0].sender or own) == named:
                runs[-1][2].append(env)
                continue
            part_caller = caller if named == own else senders.held(named)
            if part_caller is None:
                where = f"message {index} ({errors.clip(env.message_id) or 'no id'})"
                raise errors.PermissionDenied(
                    f"{where} names sender {errors.clip(named)} but the credential is {own}'s, and this stream"
                    " holds no credential of that agent: an agent can only send as itself",
                    reason=Reason.SENDER_MISMATCH,
                    metadata={"index": str(index), "claimed_sender": errors.clip(named), "sender": own})
            runs.append((part_caller, index, [env]))
        return runs

    async def _checked(self, caller: Caller, envelopes: list[envelope_pb2.Envelope],
                       first_index: int = 0, frontiers: dict[str, Frontier | None] | None = None) -> AgentRecord:
        """The sending agent, once the messages are valid and their hop counts and trails are set.
        first_index: where these messages start in their request (the index errors name); frontiers:
        senders' frontiers read for this call already (_frontiers_of)."""
        sender = caller.require_agent("sending")
        self._validate(sender.agent_id, envelopes, first_index)
        await self._continue_chains(sender.agent_id, envelopes, frontiers)
        return sender

    async def _frontiers_of(self, agent_ids: list[str]) -> dict[str, Frontier | None]:
        """The frontiers of these senders that this process holds no copy of, read at the same time (on
        JetStream one batched read, where one sender after the other would each wait for their own): the
        requests of a SendStream read are checked in order, each after the one before."""
        unknown = [agent_id for agent_id in agent_ids if agent_id not in self._frontiers]
        if len(unknown) < 2:
            return {}
        return dict(zip(unknown, await asyncio.gather(*(self._frontier(agent_id) for agent_id in unknown))))

    async def _send_via_ioa(self, caller: Caller, sender: AgentRecord, envelopes: list[envelope_pb2.Envelope],
                            outbox: bool | None, taken_at: float) -> list[SendOutcome]:
        outcomes: list[SendOutcome] = []
        for via_ioa, group in itertools.groupby(envelopes, key=lambda e: e.recipient.startswith(IOA_PREFIX)):
            run = list(group)
            if not via_ioa:
                outcomes += await self._send_local(caller, sender, run, taken_at)
            elif self._forward_to_ioa is None:
                outcomes += [SendOutcome(e.message_id, e.recipient, UNKNOWN_TARGET,
                                         detail="this mesh has no IOA relay (start it with --ioa-network)")
                             for e in run]
            else:
                forwarding = await self._forward_to_ioa(sender.agent_id, _outbound(sender, run), outbox)
                outcomes += await forwarding.outcomes()
        return outcomes

    async def _send_local(self, caller: Caller, sender: AgentRecord, envelopes: list[envelope_pb2.Envelope],
                          taken_at: float) -> list[SendOutcome]:
        return await self._writer.store([await self._local_items(caller, sender, envelopes, taken_at)], now_us())

    async def _local_items(self, caller: Caller, sender: AgentRecord, envelopes: list[envelope_pb2.Envelope],
                           taken_at: float) -> list[AppendItem]:
        """The messages as the store takes them; `taken_at`: when the mesh took their request
        (AppendItem.taken_at)."""
        now = now_us()
        items = []
        budget = self._limits.conversation_budget
        for env in envelopes:
            env.sender = sender.agent_id
            env.created_at_us = env.created_at_us or now
            env.origin.CopyFrom(_LOCAL)
            env.sequence = env.stored_at_us = env.delivery_attempt = 0
            rejection = await self._precheck(sender.agent_id, caller, env)
            items.append(AppendItem(env, rejection, conversation_budget=budget, taken_at=taken_at))
        return items

    # -- loop guard -------------------------------------------------------------
    async def _continue_chains(self, sender_id: str, envelopes: list[envelope_pb2.Envelope],
                               frontiers: dict[str, Frontier | None] | None = None) -> None:
        """Set each message's hop_count and trail from what the mesh knows, whatever the client wrote: a
        message continues the causal chain of the message it answers (in_reply_to, when the sender
        received it) or else of what the sender consumed last (its Frontier). The trail is that chain's
        plus the sender; hop_count is one more than the chain's (a client may only claim more)."""
        if frontiers is not None and sender_id in frontiers:
            frontier = frontiers[sender_id]
        else:
            frontier = await self._frontier(sender_id)
        for env in envelopes:
            cause = frontier
            if env.in_reply_to:
                answered = await self._store.get_message_by_sender(env.recipient, env.in_reply_to)
                if answered is not None and answered.envelope.recipient == sender_id and (
                        cause is None or answered.envelope.hop_count >= cause.hop_count):
                    cause = Frontier(answered.envelope.hop_count, tuple(answered.envelope.trail))
            del env.trail[:]
            if cause is not None:
                env.hop_count = max(env.hop_count, cause.hop_count + 1)
                env.trail.extend(cause.trail)
            env.trail.append(sender_id)

    async def _frontier(self, agent_id: str) -> Frontier | None:
        if agent_id in self._frontiers:
            self._frontiers.move_to_end(agent_id)
            return self._frontiers[agent_id]
        frontier = await self._store.get_frontier(agent_id)
        if self._store.fresh_delivery:  # this process sees every ack of this store: the copy stays true
            self._remember_frontier(agent_id, frontier)
        return frontier

    def _remember_frontier(self, agent_id: str, frontier: Frontier | None) -> None:
        self._frontiers[agent_id] = frontier
        self._frontiers.move_to_end(agent_id)
        while len(self._frontiers) > _FRONTIERS_KEPT:
            self._frontiers.popitem(last=False)

    async def _precheck(self, sender_id: str, caller: Caller, env: envelope_pb2.Envelope) -> tuple[int, str] | None:
        """Rejections decided from facts that never change (existence, scope, hops)."""
        rejection = self._writer.loop_rejection(env)
        if rejection is not None:
            return rejection
        if env.recipient.startswith(CHANNEL_PREFIX):
            return await self._to_channel(sender_id, env)
        if env.recipient.startswith(A2A_PREFIX):
            return await self._to_a2a(env)
        target = await self._directory.get(env.recipient)
        if target is None:
            return UNKNOWN_TARGET, f"no agent {env.recipient}"
        if not self._directory.in_reach(caller, target):
            return NOT_PERMITTED, f"{env.recipient} is outside {sender_id}'s scope"
        return None

    async def _to_channel(self, sender_id: str, env: envelope_pb2.Envelope) -> tuple[int, str] | None:
        """An answer on a channel (`channel:<channel>/<account>/<kind>:<peer>`, the sender address of what
        ingress stored): stored in that channel account's gateway agent's inbox, the address kept in the
        header `inboxmesh-channel-to` (docs/routing.md "Answers"). Only the agents of a session of that
        channel account may answer on it."""
        address = env.recipient
        if self._channel_gateway is None:
            return UNKNOWN_TARGET, "this mesh routes no channels (start it with --routing)"
        channel, _, rest = address.removeprefix(CHANNEL_PREFIX).partition("/")
        account, _, peer = rest.partition("/")
        if not channel or not account:
            return UNKNOWN_TARGET, (f"{address[:200]!r} is not a channel address"
                                    " (channel:<channel>/<account>/<kind>:<peer>)")
        sender = await self._directory.get(sender_id)
        root = await self._directory.get(sender.scope_id) if sender is not None else None
        origin = root.metadata if root is not None else {}
        if (origin.get("inboxmesh-route-channel"), origin.get("inboxmesh-route-account")) != (channel, account):
            return NOT_PERMITTED, (f"{sender_id} is not in a session of channel {channel}/{account}: only the agents"
                                   " of a session answer on its channel")
        gateway = await self._channel_gateway(channel, account)
        env.headers[CHANNEL_TO_HEADER] = address
        env.recipient = gateway.agent_id
        return None

    async def _to_a2a(self, env: envelope_pb2.Envelope) -> tuple[int, str] | None:
        """A message to an A2A agent (`a2a:<agent card URL>`) or to a caller of an exposed agent
        (`a2a:client/...`, the sender of what the A2A gateway delivered): stored in the A2A gateway agent's
        inbox, the address kept in the header `inboxmesh-a2a-to` (docs/interop.md)."""
        address = env.recipient
        rest = address.removeprefix(A2A_PREFIX)
        if not (rest.startswith(("http://", "https://", "client/")) and len(rest) > len("client/")):
            return UNKNOWN_TARGET, (f"{errors.clip(address, 200)!r} is not an A2A address (a2a:<agent card URL>,"
                                    " or the a2a:client/... sender of a message from an A2A client)")
        gateway = await self._a2a_gateway() if self._a2a_gateway is not None else None
        if gateway is None:
            return UNKNOWN_TARGET, "this mesh has no A2A gateway: start one with `inboxmesh a2a` (docs/interop.md)"
        env.headers[A2A_TO_HEADER] = address
        env.recipient = gateway.agent_id
        return None

    # -- subscribe / ack ----------------------------------------------------
    async def subscribe(self, callers: list[Caller], max_in_flight: int, peer: str) -> Subscription:
        agent_ids = await self.open_agents(callers, "subscribing")
        subscription = self.hub.open(agent_ids, max_in_flight, peer)
        await self._events.record_events(
            self.hub.subscription_events(ev.EVENT_KIND_SUBSCRIBED, agent_ids, f"from {peer}")
        )
        return subscription

    async def open_agents(self, callers: Sequence[Caller], action: str) -> list[str]:
        """The agents of these callers, each once, in order; refused when one is the admin token or a
        closed agent (its inbox delivers nothing), or when there are none."""
        agent_ids: list[str] = []
        for caller in callers:
            agent = caller.require_agent(action)
            if agent.agent_id in agent_ids:
                continue
            fresh = await self._directory.fresh(agent.agent_id)
            if not fresh.is_open:
                raise errors.FailedPrecondition(f"agent {agent.agent_id} is closed; its inbox delivers nothing",
                                                reason=Reason.AGENT_CLOSED, metadata={"agent_id": agent.agent_id})
            agent_ids.append(agent.agent_id)
        if not agent_ids:
            raise errors.InvalidArgument(f"{action} names no agent", reason=Reason.MISSING_FIELD)
        return agent_ids

    async def attach(self, subscription: Subscription, agent_ids: list[str], max_in_flight: int) -> None:
        """Add open agents (open_agents) to an open subscription; recorded as SUBSCRIBED. The feeds are
        added before this coroutine first waits: a caller that checked the subscription is still open
        just before calling it knows they were added to an open one."""
        feeds = subscription.feeds
        new = [a for a in agent_ids if a not in feeds or feeds[a].ended is not None]  # others keep their feeds
        self.hub.attach(subscription, agent_ids, max_in_flight)
        if new:
            await self._events.record_events(
                self.hub.subscription_events(ev.EVENT_KIND_SUBSCRIBED, new, f"attached from {subscription.peer}"))

    async def detach(self, subscription: Subscription, agent_ids: list[str]) -> list[str]:
        """Stop delivering for these agents on the subscription; returns those it delivered for (recorded as
        UNSUBSCRIBED)."""
        detached = self.hub.detach(subscription, agent_ids)
        if detached:
            await self._events.record_events(self.hub.subscription_events(
                ev.EVENT_KIND_UNSUBSCRIBED, detached, f"detached from {subscription.peer}"))
        return detached

    async def unsubscribed(self, subscription: Subscription, why: str) -> None:
        released = self.hub.release(subscription)
        log.info("subscription %r ended (%s)", subscription, why)
        if released:
            try:
                await self._events.record_events(self.hub.subscription_events(ev.EVENT_KIND_UNSUBSCRIBED, released,
                                                                             why))
            except errors.Unavailable as exc:  # the mesh is stopping: the store is already closed
                log.info("unsubscribed event of %s not recorded: %s", ", ".join(released), exc.message)

    @property
    def max_ack_sequences(self) -> int:
        """The most sequences one ack (or one ack of many agents) may name."""
        return 10 * self._limits.max_batch_messages

    @property
    def max_id_length(self) -> int:
        return self._limits.max_id_length

    @property
    def max_batch_messages(self) -> int:
        """The most messages one send request may hold."""
        return self._limits.max_batch_messages

    def checked_ack(self, caller: Caller, agent_id: str, sequences: list[int]) -> str:
        """The agent whose inbox an ack consumes from, once the ack is valid; raises its refusal."""
        agent = caller.require_agent("acking")
        if agent_id and agent_id != agent.agent_id:
            raise errors.PermissionDenied(
                f"ack names agent {errors.clip(agent_id)} but the credential is {agent.agent_id}'s: an agent acks only"
                " its own inbox",
                reason=Reason.AGENT_MISMATCH,
            )
        if not sequences:
            raise errors.InvalidArgument("ack names no sequences", reason=Reason.MISSING_FIELD,
                                         metadata={"field": "sequences"})
        if len(sequences) > self.max_ack_sequences:
            raise errors.InvalidArgument(f"{len(sequences)} sequences in one ack; at most "
                                         f"{self.max_ack_sequences}", reason=Reason.BATCH_TOO_LARGE)
        return agent.agent_id

    async def ack(self, caller: Caller, agent_id: str, sequences: list[int], turn: int = 0) -> list[AckOutcome]:
        recipient = self.checked_ack(caller, agent_id, sequences)
        return (await self.ack_checked([(recipient, sequences, turn)]))[0]

    async def ack_checked(self, acks: Sequence[tuple[str, list[int], int]]) -> list[list[AckOutcome]]:
        """Acks that checked_ack passed, (agent id it returned, sequences, turn) each, in one store write
        (InboxStore.ack_many: one commit on SQLite, however many agents); each ack's outcomes in turn,
        traced, logged and told to the delivery hub."""
        stored = [(recipient, [stored_int(s) for s in sequences], stored_int(turn))
                  for recipient, sequences, turn in acks]
        if len(stored) == 1:
            (one, one_sequences, one_turn), = stored
            results = [await self._store.ack(one, one_sequences, now_us(), one_turn)]
        else:
            results = await self._store.ack_many(stored, now_us())
        crash_point("ack-stored")
        for (recipient, sequences, _), outcomes in zip(acks, results):
            self._acked(recipient, sequences, outcomes)
        return results

    def _acked(self, recipient: str, sequences: list[int], outcomes: list[AckOutcome]) -> None:
        frontier = Frontier.of(o.envelope for o in outcomes if o.envelope is not None)
        if frontier is not None:
            self._remember_frontier(recipient, frontier)
        for outcome in outcomes:
            if outcome.status == pb.ACK_STATUS_CONSUMED:
                if outcome.traceparent:
                    carrier_ctx = context_of(envelope_pb2.Envelope(trace={"traceparent": outcome.traceparent}))
                    tracer.start_span("ack", context=carrier_ctx, attributes={
                        "messaging.message.id": outcome.message_id, "inboxmesh.recipient": recipient,
                        "inboxmesh.sequence": outcome.sequence}).end()
            elif log.isEnabledFor(logging.INFO):
                log.info("ack of seq %d in %s's inbox: %s", outcome.sequence, recipient,
                         pb.AckStatus.Name(outcome.status))
        self.hub.on_acked(recipient, sequences)

    # -- queries ------------------------------------------------------------
    async def status(self, caller: Caller, key: pb.MessageKey) -> MessageRecord:
        which = key.WhichOneof("key")
        if which == "by_sender":
            sender = key.by_sender.sender or caller.require_agent("naming no sender").agent_id
            check_text("message_id", key.by_sender.message_id, max_len=self._limits.max_id_length, required=True)
            record = await self._store.get_message_by_sender(sender, key.by_sender.message_id)
            name = f"message {key.by_sender.message_id!r} from {sender}"
        elif which == "by_inbox":
            recipient = key.by_inbox.recipient or caller.require_agent("naming no recipient").agent_id
            record = await self._store.get_message_by_inbox(recipient, stored_int(key.by_inbox.sequence))
            name = f"message {key.by_inbox.sequence} in {recipient}'s inbox"
        else:
            raise errors.InvalidArgument("key must be by_sender or by_inbox", reason=Reason.MISSING_FIELD)
        if record is None:
            raise errors.NotFound(f"no {name}", reason=Reason.MESSAGE_NOT_FOUND)
        await self._check_may_see(caller, record.envelope.sender, record.envelope.recipient, name)
        return record

    async def dead_letters(
        self, caller: Caller, *, recipient: str, sender: str, size: int, page_token: str
    ) -> tuple[list[MessageRecord], str]:
        if recipient and sender:
            raise errors.InvalidArgument("give recipient or sender, not both", reason=Reason.CONFLICTING_FIELDS)
        if not recipient and not sender:
            recipient = caller.require_agent("naming no agent").agent_id
        subject = await self._directory.require(recipient or sender)
        self._directory.check_reach(caller, subject, "list the dead letters of")
        limit = page_size(size)
        while True:
            records, token = await self._store.list_dead_letters(
                recipient=recipient, sender=sender, after_key=page_token, limit=limit)
            fit = fitting(r.envelope.ByteSize() + 64 for r in records)
            if fit == len(records):
                return records, token
            limit = fit  # too many bytes: ask again for the ones that fit, so the store's token follows them

    async def _check_may_see(self, caller: Caller, sender: str, recipient: str, name: str) -> None:
        for agent_id in (sender, recipient):
            record = await self._directory.get(agent_id)
            if record is not None and self._directory.in_reach(caller, record):
                return
        raise errors.PermissionDenied(f"{caller} may not see {name}: outside its scope", reason=Reason.OUT_OF_SCOPE)


def _outbound(sender: AgentRecord, envelopes: list[envelope_pb2.Envelope]) -> list[envelope_pb2.Envelope]:
    """Messages to IOA recipients as the relay publishes them: the sender's id and their creation time set."""
    for env in envelopes:
        env.sender = sender.agent_id
        env.created_at_us = env.created_at_us or now_us()
    return envelopes
