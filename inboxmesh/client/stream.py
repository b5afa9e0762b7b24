"""Following agents' inboxes from a host: one Consume stream for many
agents (deliveries in, acks out on the same stream), resubscribing after
failures.

The mesh redelivers everything not yet acked when a stream is opened again,
and exactly one ack of a message ever reports CONSUMED. `consume` returns
only the messages whose ack this host won, so a host that injects exactly
what `consume` returns never takes a message into an agent's context twice.
An ack the mesh refuses (it named the wrong agent, no or too many sequences)
fails that `consume` alone with the matching MeshError; the stream goes on.

When the last of its agents is closed or superseded the stream half-closes
its side, so that no ack of it races the end of the call: the mesh answers
every ack it was sent and then ends the call cleanly.

Bounds: deliveries wait in an in-memory queue until the host takes them;
the mesh never has more than `max_in_flight` unacked messages out per agent,
so that queue cannot outgrow agents x max_in_flight.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.mesh import AgentHandle
from inboxmesh.client.status import ERROR_OF, from_rpc_error
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2

log = logging.getLogger(__name__)
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class _End:
    """The reader's last item: the call ended without an error."""


_ENDED = _End()
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass
class StreamItem:
    """What the stream produced: messages, or a change for one agent."""

    messages: list[envelope_pb2.Envelope] = field(default_factory=list)
    agent_event: inbox_pb2.SubscriptionEvent | None = None


_Item: TypeAlias = StreamItem | grpc.aio.AioRpcError | _End


class _Items(asyncio.Queue[_Item]):
    """What the reader hands over (StreamItem, a failed call's AioRpcError, or _ENDED), with a look at
    the next one. Unbounded: deliveries are bounded by the mesh (max_in_flight per agent)."""

    _queue: collections.deque[_Item]  # asyncio.Queue's storage, declared the way LifoQueue does

    def _init(self, maxsize: int) -> None:
        self._queue = collections.deque()

    def peek(self) -> _Item:
        """The next item, left in the queue (the queue must not be empty)."""
        return self._queue[0]


class InboxStream:
    """Deliveries for a set of agents, across reconnects.

    `async for item in stream:` yields StreamItems until every agent was
    closed or superseded, or `stop()` is called. `await stream.consume(...)`
    acks on the same stream.
    """

    def __init__(
        self,
        agents: list[AgentHandle],
        *,
        max_in_flight: int = 0,
        min_backoff: float = 0.05,
        max_backoff: float = 2.0,
        max_failures: int | None = None,
        ack_timeout: float = 30.0,
    ):
        if not agents:
            raise ValueError("an InboxStream needs at least one agent")
        self.agents = {a.agent_id: a for a in agents}
        self.max_in_flight = max_in_flight
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.max_failures = max_failures
        self.ack_timeout = ack_timeout
        self.reconnects = 0
        self._call: grpc.aio.StreamStreamCall | None = None
        self._write_lock = asyncio.Lock()
        self._acks: dict[int, asyncio.Future] = {}
        self._ack_ids = itertools.count(1)
        self._stopped = False
        self._half_close: asyncio.Task | None = None

    def stop(self) -> None:
        self._stopped = True
        if self._call is not None:
            self._call.cancel()

    async def __aiter__(self) -> AsyncGenerator[StreamItem, None]:
        failures = 0
        while self.agents and not self._stopped:
            first = next(iter(self.agents.values()))
            call = self._call = first.client.inbox.Consume()
            items = _Items()
            reader = asyncio.create_task(self._read(call, items))
            failure: errors.MeshError | None = None
            try:
                await self._write(inbox_pb2.ConsumeRequest(subscribe=inbox_pb2.SubscribeRequest(
                    credentials=[a.credential for a in self.agents.values()], max_in_flight=self.max_in_flight)))
                while not isinstance(item := await items.get(), _End):
                    if isinstance(item, StreamItem):
                        if item.messages:
                            item = self._coalesce(item, items)
                        failures = 0
                        yield item
                        continue
                    if self._stopped:  # item is the failed call's AioRpcError
                        return
                    if item.code() not in _RETRYABLE:
                        raise from_rpc_error(item) from None
                    failure = from_rpc_error(item)
                    break
                else:
                    if self._stopped or not self.agents:
                        return
                    failure = errors.Unavailable("the stream ended", reason=Reason.STREAM_LOST)
            except grpc.aio.AioRpcError as exc:  # the subscribe write failed
                if exc.code() not in _RETRYABLE:
                    raise from_rpc_error(exc) from None
                failure = from_rpc_error(exc)
            finally:
                call.cancel()
                reader.cancel()
                if self._half_close is not None:
                    self._half_close.cancel()
                    self._half_close = None
                self._fail_acks(errors.Unavailable("the inbox stream was lost before the ack was answered",
                                                   reason=Reason.STREAM_LOST))
            failures += 1
            if self.max_failures is not None and failures > self.max_failures:
                raise failure
            delay = min(self.max_backoff, self.min_backoff * 2 ** (failures - 1)) * (0.5 + random.random() / 2)
            log.info("inbox stream for %s lost (%s); resubscribing in %.2fs", ", ".join(self.agents), failure, delay)
            self.reconnects += 1
            await asyncio.sleep(delay)

    @staticmethod
    def _coalesce(item: StreamItem, items: _Items) -> StreamItem:
        """Join deliveries already waiting behind this one, so a host takes
        everything pending in one go (one ack, one turn)."""
        while not items.empty():
            following = items.peek()  # only plain deliveries are joined, in order
            if not (isinstance(following, StreamItem) and following.messages):
                break
            items.get_nowait()
            item.messages.extend(following.messages)
        return item

    async def _read(self, call: grpc.aio.StreamStreamCall, items: _Items) -> None:
        try:
            async for response in call:
                which = response.WhichOneof("event")
                if which == "deliveries":
                    items.put_nowait(StreamItem(messages=list(response.deliveries.messages)))
                elif which == "acked":
                    self._answer(response.acked)
                elif which == "subscription":
                    event = response.subscription
                    if event.kind in (inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED,
                                      inbox_pb2.SUBSCRIPTION_EVENT_KIND_SUPERSEDED):
                        self.agents.pop(event.agent_id, None)
                        if not self.agents and self._half_close is None:
                            # not awaited here: the reader must go on reading while acks wait to be written
                            self._half_close = asyncio.create_task(self._done_writing(call))
                    items.put_nowait(StreamItem(agent_event=event))
            items.put_nowait(_ENDED)
        except grpc.aio.AioRpcError as exc:
            items.put_nowait(exc)
        except asyncio.CancelledError:
            items.put_nowait(_ENDED)
        except Exception as exc:  # the call broke some other way: say so, or the stream would wait forever
            log.warning("inbox stream read failed: %r", exc)
            items.put_nowait(_ENDED)

    def _answer(self, acked: inbox_pb2.AckResponse) -> None:
        """Hand the answer of one ack to the consume() waiting for it."""
        future = self._acks.pop(acked.request_id, None)
        if future is None or future.done():
            return
        if acked.HasField("error"):
            future.set_exception(ack_error(acked))
        else:
            future.set_result(list(acked.results))

    async def _write(self, request: inbox_pb2.ConsumeRequest) -> None:
        """Write on the current call (the one open when the write's turn comes)."""
        async with self._write_lock:
            if self._call is None:  # never connected (ack() refuses before that)
                raise errors.Unavailable("the inbox stream is not connected", reason=Reason.STREAM_LOST)
            await self._call.write(request)

    async def _done_writing(self, call) -> None:
        """No agent is left on the stream: half-close it after the acks
        already being written, so the mesh can end the call once it answered
        them. Later acks are refused here (Unavailable), never written."""
        try:
            async with self._write_lock:
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.debug("inbox stream for %s: half-close after its last agent left failed: %r", call, exc)

    def _fail_acks(self, failure: errors.MeshError) -> None:
        for future in self._acks.values():
            if not future.done():
                future.set_exception(failure)
        self._acks.clear()

    async def ack(self, agent_id: str, sequences: list[int], turn: int = 0) -> list[inbox_pb2.AckResult]:
        """Ack on the stream; raises Unavailable when the stream is lost first
        (the messages then come again and can be acked again), and the
        MeshError of the refusal when the mesh refused this ack (the stream
        goes on)."""
        if self._call is None:
            raise errors.Unavailable("the inbox stream is not connected", reason=Reason.STREAM_LOST)
        request_id = next(self._ack_ids)
        future = asyncio.get_running_loop().create_future()
        self._acks[request_id] = future
        try:
            await self._write(inbox_pb2.ConsumeRequest(ack=inbox_pb2.AckRequest(
                agent_id=agent_id, sequences=sequences, request_id=request_id, turn=turn)))
        except grpc.aio.AioRpcError as exc:
            self._forget(request_id, future)
            raise errors.Unavailable(f"could not ack on the inbox stream: {exc.details()}",
                                     reason=Reason.STREAM_LOST) from None
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:  # the call ended or was half-closed
            self._forget(request_id, future)
            raise errors.Unavailable(f"could not ack on the inbox stream: {exc}",
                                     reason=Reason.STREAM_LOST) from None
        return await asyncio.wait_for(future, self.ack_timeout)

    def _forget(self, request_id: int, future: asyncio.Future) -> None:
        """An ack that was never written: nobody will await its future (the
        stream's end may already have failed it)."""
        self._acks.pop(request_id, None)
        if not future.done():
            future.cancel()
        elif not future.cancelled():
            future.exception()  # retrieved: it is reported as the write's failure instead

    async def consume(self, agent_id: str, messages: list[envelope_pb2.Envelope], turn: int = 0,
                      taken: set[tuple[str, str]] | None = None) -> list[envelope_pb2.Envelope]:
        """Ack the agent's messages on the stream (for `turn`, recorded on the
        consumed events); return those this ack consumed, in order.
        Dead-lettered ones are left out, and so are already-consumed ones,
        except when `taken` is given ((sender, message_id) of what the agent
        already took in): an already-consumed message the agent has not
        taken in was consumed by an earlier ack of its own whose answer was
        lost (the stream or the mesh went away after the mesh recorded it;
        only the agent itself can ack its inbox), so it is the agent's now."""
        mine = [m for m in messages if m.recipient == agent_id]
        if not mine:
            return []
        results = await self.ack(agent_id, [m.sequence for m in mine], turn)
        won = {r.sequence for r in results if r.status == inbox_pb2.ACK_STATUS_CONSUMED}
        if taken is not None:
            won |= {r.sequence for r in results if r.status == inbox_pb2.ACK_STATUS_ALREADY_CONSUMED}
            return [m for m in mine if m.sequence in won and (m.sender, m.message_id) not in taken]
        return [m for m in mine if m.sequence in won]


def ack_error(acked: inbox_pb2.AckResponse) -> errors.MeshError:
    """The MeshError for an ack the mesh refused on a Consume stream, as the
    unary Ack would have raised it."""
    error = acked.error
    code = _STATUS_CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    return ERROR_OF.get(code, errors.MeshError)(error.message or code.name,
                                                reason=errors.reason_of(error.reason or code.name),
                                                metadata=dict(error.metadata))


async def consume(agent: AgentHandle, messages: list[envelope_pb2.Envelope]) -> list[envelope_pb2.Envelope]:
    """Like InboxStream.consume, with the unary Ack call (no stream needed)."""
    mine = [m for m in messages if m.recipient == agent.agent_id]
    if not mine:
        return []
    results = await agent.ack(m.sequence for m in mine)
    won = {r.sequence for r in results if r.status == inbox_pb2.ACK_STATUS_CONSUMED}
    return [m for m in mine if m.sequence in won]
