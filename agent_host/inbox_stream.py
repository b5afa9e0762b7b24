"""Following agents' inboxes from a host: one Subscribe stream for many
agents, resubscribing after failures, and consuming through acks.

The mesh redelivers everything not yet acked when a stream is opened again,
and exactly one ack of a message ever reports CONSUMED. `consume` returns
only the messages whose ack this host won, so a host that injects exactly
what `consume` returns never takes a message into an agent's context twice.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2
from services import errors
from services.client import AgentHandle
from services.grpc_status import from_rpc_error

log = logging.getLogger(__name__)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


@dataclass
class StreamItem:
    """What the stream produced: messages, or a change for one agent."""

    messages: list[envelope_pb2.Envelope] = field(default_factory=list)
    agent_event: inbox_pb2.SubscriptionEvent | None = None


class InboxStream:
    """Deliveries for a set of agents, across reconnects.

    `async for item in stream:` yields StreamItems until every agent was
    closed or superseded, or `stop()` is called.
    """

    def __init__(
        self,
        agents: list[AgentHandle],
        *,
        max_in_flight: int = 0,
        min_backoff: float = 0.05,
        max_backoff: float = 2.0,
        max_failures: int | None = None,
    ):
        if not agents:
            raise ValueError("an InboxStream needs at least one agent")
        self.agents = {a.agent_id: a for a in agents}
        self.max_in_flight = max_in_flight
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.max_failures = max_failures
        self.reconnects = 0
        self._call = None
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True
        if self._call is not None:
            self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        failures = 0
        while self.agents and not self._stopped:
            first, *rest = self.agents.values()
            self._call = first.subscribe(self.max_in_flight, extra=rest)
            try:
                async for response in self._call:
                    failures = 0
                    which = response.WhichOneof("event")
                    if which == "deliveries":
                        yield StreamItem(messages=list(response.deliveries.messages))
                    elif which == "subscription":
                        event = response.subscription
                        if event.kind in (inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED,
                                          inbox_pb2.SUBSCRIPTION_EVENT_KIND_SUPERSEDED):
                            self.agents.pop(event.agent_id, None)
                        yield StreamItem(agent_event=event)
                if self._stopped or not self.agents:
                    return
                failure: errors.MeshError = errors.Unavailable("the stream ended")
            except grpc.aio.AioRpcError as exc:
                if self._stopped:
                    return
                if exc.code() not in _RETRYABLE:
                    raise from_rpc_error(exc) from None
                failure = from_rpc_error(exc)
            finally:
                self._call.cancel()
            failures += 1
            if self.max_failures is not None and failures > self.max_failures:
                raise failure
            delay = min(self.max_backoff, self.min_backoff * 2 ** (failures - 1)) * (0.5 + random.random() / 2)
            log.info("inbox stream for %s lost (%s); resubscribing in %.2fs", ", ".join(self.agents), failure, delay)
            self.reconnects += 1
            await asyncio.sleep(delay)


async def consume(agent: AgentHandle, messages: list[envelope_pb2.Envelope]) -> list[envelope_pb2.Envelope]:
    """Ack the agent's messages; return those this ack consumed (in order).
    Messages already consumed earlier, or dead-lettered, are left out."""
    mine = [m for m in messages if m.recipient == agent.agent_id]
    if not mine:
        return []
    results = await agent.ack(m.sequence for m in mine)
    won = {r.sequence for r in results if r.status == inbox_pb2.ACK_STATUS_CONSUMED}
    return [m for m in mine if m.sequence in won]
