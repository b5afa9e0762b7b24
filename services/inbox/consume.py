"""One Consume stream's agents: whose acks it takes, and which agents it delivers for while agents are
attached to and detached from the open stream. Knows nothing of gRPC: services.inbox.grpc_handler reads
the stream, asks this class, and writes what it answers."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.inbox.v1 import inbox_pb2 as pb
from services.directory import Caller
from services.inbox.delivery import Subscription
from services.inbox.service import InboxService, Prove
from services.store.base import AckOutcome
from services.validation import check_text

log = logging.getLogger(__name__)
STREAM_AGENTS = 100_000
"""The most agents one Consume stream delivers for at once (an attach beyond: RESOURCE_EXHAUSTED /
STREAM_FULL)."""
PER_REQUEST = 10_000
"""The most credentials one attach, and agent ids one detach, may name (INVALID_ARGUMENT /
BATCH_TOO_LARGE)."""
LEFT_KEPT = 1024
"""Agents that left the stream (closed, superseded, detached) whose acks it still answers, most recent
last; an ack for one forgotten is refused as for an agent the stream never had (AGENT_MISMATCH)."""
_SHOWN_ID = 64
REFUSALS = (errors.InvalidArgument, errors.PermissionDenied, errors.FailedPrecondition, errors.NotFound,
            errors.ResourceExhausted, errors.Unauthenticated)
"""Errors that say a request on a Consume stream was wrong: answered on the stream for that request alone.
Others (the mesh could not process it) end the stream, and the host subscribes again; but for acks, below."""
ACK_ANSWERED = (*REFUSALS, errors.Unavailable)
"""What an ack or ack_many is answered with on the stream, the stream going on: its refusals, and
Unavailable (the store did not answer, too much contention): the host retries the ack on the same stream
(inboxmesh.client.stream.InboxStream does), whose deliveries stay in flight. Ending the stream would have
every unacked message delivered again, one more attempt each."""
_ENDS = (pb.SUBSCRIPTION_EVENT_KIND_CLOSED, pb.SUBSCRIPTION_EVENT_KIND_SUPERSEDED)


@dataclass
class AckAnswer:
    """The answer to one ack: the agent it was taken for (empty when it named none of the stream's) and its
    outcomes, or the refusal (nothing of it recorded)."""

    agent_id: str
    outcomes: list[AckOutcome] = field(default_factory=list)
    refusal: errors.MeshError | None = None


def _shown(value: str) -> str:
    """A caller's string as an error may quote it: bounded."""
    return value if len(value) <= _SHOWN_ID else f"{value[:_SHOWN_ID]}... ({len(value)} characters)"


class ConsumeSession:
    def __init__(self, service: InboxService, subscription: Subscription, callers: dict[str, Caller],
                 prove: Prove, max_in_flight: int):
        self._service = service
        self._subscription = subscription
        self._prove = prove
        self._max_in_flight = max_in_flight
        """The `subscribe`'s, for an attach that names none."""
        self._attached: dict[str, Caller] = dict(callers)
        """Agents the stream delivers for, by the credentials it proved (at most STREAM_AGENTS)."""
        self._left: collections.OrderedDict[str, Caller] = collections.OrderedDict()
        """Agents that left the stream, most recent last (at most LEFT_KEPT): their acks are still taken."""
        self.ending = False
        """The subscription stopped producing (its last agent left, or the mesh is stopping): an attach is
        refused from then on, since nothing would deliver for it."""

    # -- acks -------------------------------------------------------------------
    def ack_caller(self, request: pb.AckRequest) -> tuple[str, Caller]:
        """Which of the stream's agents an ack is for. An empty agent_id
        means the stream's one agent; on a stream of several it names none."""
        if not request.agent_id:
            if len(self._attached) + len(self._left) == 1:
                return next(iter({**self._attached, **self._left}.items()))
            raise errors.InvalidArgument(
                f"the ack names no agent, and this stream delivers for {len(self._attached) + len(self._left)}:"
                " set agent_id", reason=Reason.MISSING_FIELD, metadata={"field": "agent_id"})
        caller = self._attached.get(request.agent_id) or self._left.get(request.agent_id)
        if caller is None:
            shown = _shown(request.agent_id)
            raise errors.PermissionDenied(
                f"ack names agent {shown!r}, which this stream did not subscribe: ack on the stream that"
                " delivers for it, or with that agent's own credential",
                reason=Reason.AGENT_MISMATCH, metadata={"agent_id": shown})
        return request.agent_id, caller

    async def ack(self, request: pb.AckRequest) -> AckAnswer:
        agent_id = ""
        try:
            agent_id, caller = self.ack_caller(request)
            outcomes = await self._service.ack(caller, agent_id, list(request.sequences), request.turn)
        except ACK_ANSWERED as exc:  # this ack was wrong, or not processed now; the stream carries on
            log.info("Consume on %r: ack %d not taken: %s (%s)", self._subscription, request.request_id,
                     exc.reason, exc.message)
            return AckAnswer(agent_id, refusal=exc)
        return AckAnswer(agent_id, outcomes)

    async def ack_many(self, request: pb.AckManyRequest) -> list[AckAnswer]:
        """Every entry checked as `ack` checks one (a refused entry is answered alone, nothing of it
        recorded), and the others acked in one store write (InboxStore.ack_many: one commit on SQLite,
        on JetStream the requests of all entries together). Raises a refusal of the request as a whole
        (ACK_ANSWERED: also Unavailable, when the store did not process it; some entries may be recorded, and
        a retry answers those ALREADY_CONSUMED)."""
        if not request.acks:
            raise errors.InvalidArgument("the ack_many holds no acks", reason=Reason.MISSING_FIELD,
                                         metadata={"field": "acks"})
        total = sum(len(entry.sequences) for entry in request.acks)
        if total > self._service.max_ack_sequences:
            raise errors.InvalidArgument(f"{total} sequences in one ack_many; at most"
                                         f" {self._service.max_ack_sequences}", reason=Reason.BATCH_TOO_LARGE)
        answers: list[AckAnswer] = []
        checked: list[tuple[AckAnswer, tuple[str, list[int], int]]] = []
        for entry in request.acks:
            answer = AckAnswer("")
            try:
                answer.agent_id, caller = self.ack_caller(entry)
                sequences = list(entry.sequences)
                checked.append((answer, (self._service.checked_ack(caller, answer.agent_id, sequences), sequences,
                                         entry.turn)))
            except REFUSALS as exc:  # this entry was wrong; the others are acked
                log.info("Consume on %r: ack %d refused: %s (%s)", self._subscription, entry.request_id, exc.reason,
                         exc.message)
                answer.refusal = exc
            answers.append(answer)
        if checked:
            for (answer, _), outcomes in zip(checked, await self._service.ack_checked([c for _, c in checked])):
                answer.outcomes = outcomes
        return answers

    # -- attach and detach ---------------------------------------------------------
    async def attach(self, request: pb.AttachRequest) -> None:
        """Add the agents the request's credentials prove (all or none); the hub announces each (ATTACHED)
        before its first delivery, also one the stream already delivered for (it keeps its feed). Raises
        the refusal."""
        credentials = list(dict.fromkeys(request.credentials))
        if not credentials:
            raise errors.InvalidArgument("the attach holds no credentials", reason=Reason.MISSING_FIELD,
                                         metadata={"field": "credentials"})
        if len(credentials) > PER_REQUEST:
            raise errors.InvalidArgument(f"{len(credentials)} credentials in one attach; at most {PER_REQUEST}",
                                         reason=Reason.BATCH_TOO_LARGE)
        self._check_open()
        callers = await self._prove(credentials)
        agent_ids = await self._service.open_agents(callers, "attaching")
        by_agent = {c.agent.agent_id: c for c in callers if c.agent is not None}
        added = [a for a in agent_ids if a not in self._attached]
        if len(self._attached) + len(added) > STREAM_AGENTS:
            raise errors.ResourceExhausted(
                f"this stream delivers for {len(self._attached)} agents; with {len(added)} more it would be over"
                f" the {STREAM_AGENTS} one stream may carry: attach them on another Consume stream",
                reason=Reason.STREAM_FULL, metadata={"limit": str(STREAM_AGENTS)})
        self._check_open()  # again: proving and reading the agents waited, and the stream may have ended
        await self._service.attach(self._subscription, agent_ids, request.max_in_flight or self._max_in_flight)
        for agent_id in agent_ids:
            self._attached[agent_id] = by_agent[agent_id]
            self._left.pop(agent_id, None)

    def _check_open(self) -> None:
        if self.ending or self._subscription.stopped:
            raise errors.FailedPrecondition(
                "this Consume stream is ending (its last agent left, or the mesh is stopping): attach on a new"
                " stream", reason=Reason.STREAM_ENDING)

    async def detach(self, request: pb.DetachRequest) -> list[tuple[str, bool]]:
        """Stop delivering for the named agents here: (agent id, whether the stream delivered for it) per
        named agent, in order, each once. Raises the refusal of the request as a whole."""
        agent_ids = list(dict.fromkeys(request.agent_ids))
        if not agent_ids:
            raise errors.InvalidArgument("the detach names no agents", reason=Reason.MISSING_FIELD,
                                         metadata={"field": "agent_ids"})
        if len(agent_ids) > PER_REQUEST:
            raise errors.InvalidArgument(f"{len(agent_ids)} agents in one detach; at most {PER_REQUEST}",
                                         reason=Reason.BATCH_TOO_LARGE)
        for agent_id in agent_ids:
            check_text("agent_ids", agent_id, max_len=self._service.max_id_length, required=True)
        detached = set(await self._service.detach(self._subscription, agent_ids))
        for agent_id in agent_ids:  # none of them is delivered here any more (the hub drops what it held)
            self._leave(agent_id)
        return [(agent_id, agent_id in detached) for agent_id in agent_ids]

    def _leave(self, agent_id: str) -> None:
        caller = self._attached.pop(agent_id, None)
        if caller is not None:
            self._left[agent_id] = caller
            while len(self._left) > LEFT_KEPT:
                self._left.popitem(last=False)

    # -- what the subscription produces ----------------------------------------
    def produced(self, response: pb.SubscribeResponse) -> None:
        """The subscription produced this response: an agent closed or superseded leaves the stream."""
        if response.WhichOneof("event") == "subscription" and response.subscription.kind in _ENDS:
            self._leave(response.subscription.agent_id)
