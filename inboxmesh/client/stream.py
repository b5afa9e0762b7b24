"""Following agents' inboxes from a host: one Consume stream for many
agents (deliveries in, acks out on the same stream), resubscribing after
failures.

The mesh redelivers everything not yet acked when a stream is opened again,
and exactly one ack of a message ever reports CONSUMED. `consume` returns
only the messages whose ack this host won, so a host that injects exactly
what `consume` returns never takes a message into an agent's context twice.
An ack the mesh refuses (it named the wrong agent, no or too many sequences)
fails that `consume` alone with the matching MeshError; the stream goes on.
An ack the mesh could not process now (UNAVAILABLE: its store did not answer)
is written again on the same stream, with backoff, for as long as the stream
lasts: the deliveries stay in flight meanwhile, and a message the failed
attempt consumed after all comes back ALREADY_CONSUMED, which counts as won
by this ack (inboxmesh.client.acking.claimed).

When the last of its agents is closed, superseded or detached the stream
half-closes its side, so that no ack of it races the end of the call: the
mesh answers every ack it was sent and then ends the call cleanly.

Many agents on one stream: `attach` and `detach` add and drop agents while
the stream is open (a reconnect subscribes everything attached), and
`consume_many` acks the messages of many agents in one request (one commit
on SQLite), which is what keeps a host of many agents from spending an ack
round per message.

Bounds: deliveries wait in an in-memory queue until the host takes them;
the mesh never has more than `max_in_flight` unacked messages out per agent,
so that queue cannot outgrow agents x max_in_flight.

The answers the stream waits for (acks by request_id) and which messages an
ack won are kept in inboxmesh.client.acking.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

import grpc

from inboxmesh.client import errors
from inboxmesh.client.acking import (
    MAX_ACK_SEQUENCES,
    Answers,
    ConsumedMany,
    ack_chunks,
    ack_error,
    addressed_to,
    claimed,
    consume,
    refusal,
    won,
)
from inboxmesh.client.errors import Reason
from inboxmesh.client.mesh import AgentHandle
from inboxmesh.client.status import CALL_ENDED, from_rpc_error, own_cancel
from inboxmesh.common.v1 import envelope_pb2
from inboxmesh.inbox.v1 import inbox_pb2

__all__ = ["MAX_ACK_SEQUENCES", "ConsumedMany", "InboxStream", "StreamItem", "ack_error", "consume", "refusal"]
log = logging.getLogger(__name__)
T = TypeVar("T")
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


class _End:
    """The reader's last item: the call ended without an error."""


_ENDED = _End()
_GONE = (inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED, inbox_pb2.SUBSCRIPTION_EVENT_KIND_SUPERSEDED,
         inbox_pb2.SUBSCRIPTION_EVENT_KIND_DETACHED)
"""Events after which the stream delivers nothing more for the agent."""


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
        self._ready: grpc.aio.StreamStreamCall | None = None
        """The call once its `subscribe` is written: nothing else is written on a call before that."""
        self._write_lock = asyncio.Lock()
        self._answers = Answers()
        """Acks and ack_manys written and not answered yet."""
        self._stopped = False
        self._over = False
        """The iteration ended (every agent left, a failure, or stop()): nothing more is subscribed."""
        self._half_close: asyncio.Task | None = None
        self._attaching: dict[str, asyncio.Future[None]] = {}
        """Agents whose ATTACHED is awaited by attach()."""
        self._detaching: dict[str, asyncio.Future[None]] = {}
        """Agents whose DETACHED is awaited by detach()."""
        self._requests: dict[int, list[str]] = {}
        """attach/detach requests on the wire, by request_id: the agents they name (for a REFUSED)."""

    def stop(self) -> None:
        self._stopped = True
        if self._call is not None:
            self._call.cancel()
        self._fail_waits(errors.Unavailable("the inbox stream was stopped", reason=Reason.STREAM_LOST))

    def _fail_waits(self, failure: errors.MeshError) -> None:
        """attach() and detach() calls still waiting: they will not be answered any more."""
        for waiting in (self._attaching, self._detaching):
            for future in waiting.values():
                if not future.done():
                    future.set_exception(failure)
            waiting.clear()
        self._requests.clear()

    async def __aiter__(self) -> AsyncGenerator[StreamItem, None]:
        try:
            async for item in self._items():
                yield item
        finally:
            self._over = True
            self._fail_waits(errors.Unavailable("the inbox stream ended", reason=Reason.STREAM_LOST))

    def _check_going(self) -> None:
        if self._stopped or self._over:
            raise errors.Unavailable("the inbox stream is over (its agents all left, it failed or was stopped):"
                                     " open a new one", reason=Reason.STREAM_LOST)

    async def _items(self) -> AsyncGenerator[StreamItem, None]:
        failures = 0
        while self.agents and not self._stopped:
            first = next(iter(self.agents.values()))
            call = self._call = first.client.inbox.Consume()
            items = _Items()
            reader = asyncio.create_task(self._read(call, items))
            failure: errors.MeshError | None = None
            try:
                await self._subscribe(call)
                while not isinstance(item := await items.get(), _End):
                    if isinstance(item, StreamItem):
                        if item.messages:
                            item = self._coalesce(item, items)
                        failures = 0
                        yield item
                        continue
                    if self._stopped:  # item is the failed call's AioRpcError
                        return
                    if (closed := self._closed_meanwhile(item)) is not None:
                        yield closed
                        break  # no failure: the others subscribe again without waiting
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
            except CALL_ENDED as exc:  # (an AioRpcError is taken by the clause above)
                if own_cancel(exc):
                    raise
                # the mesh ended the call between the subscribe and an attach or detach written after it
                # (a refusal the reader hands over), or stop() cancelled it: as any stream lost
                if self._stopped:
                    return
                failure = errors.Unavailable(f"the inbox stream ended while it subscribed: {exc or type(exc).__name__}",
                                             reason=Reason.STREAM_LOST)
            finally:
                call.cancel()
                reader.cancel()
                if self._half_close is not None:
                    self._half_close.cancel()
                    self._half_close = None
                self._answers.fail_all(errors.Unavailable("the inbox stream was lost before the ack was"
                                                          " answered", reason=Reason.STREAM_LOST))
                self._ready = None
                for future in self._detaching.values():  # done: the next subscription leaves them out
                    if not future.done():
                        future.set_result(None)
                self._detaching.clear()
            if failure is None:
                continue
            failures += 1
            if self.max_failures is not None and failures > self.max_failures:
                raise failure
            delay = min(self.max_backoff, self.min_backoff * 2 ** (failures - 1)) * (0.5 + random.random() / 2)
            log.info("inbox stream for %s lost (%s); resubscribing in %.2fs", ", ".join(self.agents), failure, delay)
            self.reconnects += 1
            await asyncio.sleep(delay)

    async def _subscribe(self, call: grpc.aio.StreamStreamCall) -> None:
        """Write the call's `subscribe` for every agent of the stream; then the attach and detach of agents
        that came or went while it was written (their own requests may have found the call not ready)."""
        subscribed = list(self.agents.values())
        await self._write(inbox_pb2.ConsumeRequest(subscribe=inbox_pb2.SubscribeRequest(
            credentials=[a.credential for a in subscribed], max_in_flight=self.max_in_flight)), first_on=call)
        came = [h for h in self.agents.values() if h not in subscribed]
        went = [h.agent_id for h in subscribed if h.agent_id not in self.agents]
        if came:
            await self._write(inbox_pb2.ConsumeRequest(attach=inbox_pb2.AttachRequest(
                credentials=[h.credential for h in came], max_in_flight=self.max_in_flight)))
        if went:
            await self._write(inbox_pb2.ConsumeRequest(detach=inbox_pb2.DetachRequest(agent_ids=went)))

    def _closed_meanwhile(self, failed: grpc.aio.AioRpcError) -> StreamItem | None:
        """The subscribe named an agent closed while the stream was away (FAILED_PRECONDITION /
        AGENT_CLOSED): on a stream of several agents that agent alone ends, with a CLOSED event, and the
        others subscribe again. None for any other failure (and on a stream of one agent: the failure is
        raised, as it always was)."""
        error = from_rpc_error(failed)
        agent_id = error.metadata.get("agent_id", "")
        if error.reason != Reason.AGENT_CLOSED or agent_id not in self.agents or len(self.agents) < 2:
            return None
        del self.agents[agent_id]
        waiting = self._attaching.pop(agent_id, None)
        if waiting is not None and not waiting.done():
            waiting.set_exception(error)
        return StreamItem(agent_event=inbox_pb2.SubscriptionEvent(
            agent_id=agent_id, kind=inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED, detail=error.message))

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
                    self._answers.answer(response.acked)
                elif which == "acked_many":
                    self._answers.answer_many(response.acked_many)
                elif which == "subscription":
                    event = response.subscription
                    if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_REFUSED:
                        self._refused(event)
                        continue
                    self._settle(event)
                    if event.kind in _GONE:
                        self.agents.pop(event.agent_id, None)
                        self._half_close_if_empty(call)
                    items.put_nowait(StreamItem(agent_event=event))
            items.put_nowait(_ENDED)
        except grpc.aio.AioRpcError as exc:
            items.put_nowait(exc)
        except asyncio.CancelledError:
            items.put_nowait(_ENDED)
        except Exception as exc:  # the call broke some other way: say so, or the stream would wait forever
            log.warning("inbox stream read failed: %r", exc)
            items.put_nowait(_ENDED)
        finally:
            if self._call is call:  # no answer comes any more: the acks waiting fail now, not when the host
                self._ready = None  # next asks the stream for an item (it may be waiting for one of them)
                self._answers.fail_all(errors.Unavailable("the inbox stream was lost before the ack was"
                                                          " answered", reason=Reason.STREAM_LOST))

    def _half_close_if_empty(self, call) -> None:
        if not self.agents and self._half_close is None:
            # not awaited here: the reader must go on reading while acks wait to be written
            self._half_close = asyncio.create_task(self._done_writing(call))

    def _settle(self, event: inbox_pb2.SubscriptionEvent) -> None:
        """An event for an agent ends the attach() or detach() waiting for it."""
        waiting = self._detaching if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_DETACHED else self._attaching
        future = waiting.pop(event.agent_id, None)
        if future is not None and not future.done():
            future.set_result(None)

    def _refused(self, event: inbox_pb2.SubscriptionEvent) -> None:
        """An attach or detach was refused as a whole: its waiters fail with the refusal; the agents an
        attach named leave the stream again."""
        failure = refusal(event.error)
        for agent_id in self._requests.pop(event.request_id, []):
            for waiting in (self._attaching, self._detaching):
                future = waiting.pop(agent_id, None)
                if future is not None and not future.done():
                    future.set_exception(failure)
                    if waiting is self._attaching:
                        self.agents.pop(agent_id, None)

    async def _write(self, request: inbox_pb2.ConsumeRequest, *,
                     first_on: grpc.aio.StreamStreamCall | None = None) -> None:
        """Write on the current call (the one open when the write's turn comes), once its `subscribe` is
        written; `first_on`: this is that `subscribe`, for that call."""
        async with self._write_lock:
            if first_on is not None:
                await first_on.write(request)
                self._ready = first_on
                return
            call = self._call
            if self._ready is not call or call is None:  # reconnecting, or never connected
                raise errors.Unavailable("the inbox stream is not connected", reason=Reason.STREAM_LOST)
            await call.write(request)

    async def _done_writing(self, call) -> None:
        """No agent is left on the stream: half-close it after the acks
        already being written, so the mesh can end the call once it answered
        them. Later acks are refused here (Unavailable), never written."""
        try:
            async with self._write_lock:
                await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            log.debug("inbox stream for %s: half-close after its last agent left failed: %r", call, exc)

    async def ack(self, agent_id: str, sequences: list[int], turn: int = 0) -> list[inbox_pb2.AckResult]:
        """Ack on the stream; raises Unavailable when the stream is lost first
        (the messages then come again and can be acked again), and the
        MeshError of the refusal when the mesh refused this ack (the stream
        goes on)."""
        return await self._request_answer(lambda request_id: inbox_pb2.ConsumeRequest(ack=inbox_pb2.AckRequest(
            agent_id=agent_id, sequences=sequences, request_id=request_id, turn=turn)))

    async def _request_answer(self, request_of: Callable[[int], inbox_pb2.ConsumeRequest]) -> Any:
        """Write an ack or ack_many request (made for its request_id by `request_of`) and wait for the answer
        with its request_id. Written again, with backoff, while the mesh answers that it could not process
        it now (Unavailable, but for a lost stream); the answer to such a retry counts what it finds
        consumed already as consumed by this ack (claimed)."""
        delay = self.min_backoff
        retried = False
        while True:
            if self._call is None:
                raise errors.Unavailable("the inbox stream is not connected", reason=Reason.STREAM_LOST)
            request_id = self._answers.next_id()
            future = self._answers.expect(request_id)
            try:
                await self._write_stream(request_of(request_id), "ack")
            except errors.Unavailable:  # not connected (reconnecting), or the call is lost or over
                self._answers.forget(request_id, future)
                raise
            try:
                answer = await self._answered(future, "ack")
            except errors.Unavailable as exc:
                if exc.reason == Reason.STREAM_LOST or self._stopped:
                    raise
                log.info("ack not processed by the mesh (%s: %s); writing it again in %.2f s", exc.reason,
                         exc.message, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.max_backoff)
                retried = True
                continue
            return claimed(answer) if retried else answer

    async def ack_many(self, acks: Mapping[str, list[int]], turns: Mapping[str, int] | None = None
                       ) -> dict[str, list[inbox_pb2.AckResult] | errors.MeshError]:
        """Ack for many of the stream's agents in one request (several when they name more than
        MAX_ACK_SEQUENCES sequences in all): per agent its results, or the refusal of its ack (the others
        are recorded all the same). Raises Unavailable as `ack` does."""
        turns = turns or {}

        async def one(agent_ids: list[str]) -> dict[str, list[inbox_pb2.AckResult] | errors.MeshError]:
            entries = [inbox_pb2.AckRequest(agent_id=a, sequences=acks[a], turn=turns.get(a, 0)) for a in agent_ids]
            try:
                answer = await self._request_answer(lambda request_id: inbox_pb2.ConsumeRequest(
                    ack_many=inbox_pb2.AckManyRequest(acks=entries, request_id=request_id)))
            except errors.Unavailable:
                raise
            except errors.MeshError as exc:  # refused as a whole (too many sequences for one agent)
                return dict.fromkeys(agent_ids, exc)
            return {agent_id: ack_error(acked) if acked.HasField("error") else list(acked.results)
                    for agent_id, acked in zip(agent_ids, answer.acks)}

        found: dict[str, list[inbox_pb2.AckResult] | errors.MeshError] = {}
        for part in await asyncio.gather(*(one(chunk) for chunk in ack_chunks(acks))):
            found.update(part)
        return found

    async def consume(self, agent_id: str, messages: list[envelope_pb2.Envelope], turn: int = 0,
                      taken: set[tuple[str, str]] | None = None) -> list[envelope_pb2.Envelope]:
        """Ack the agent's messages on the stream (for `turn`, recorded on the consumed events); return
        those this ack consumed, in order (inboxmesh.client.acking.won: with `taken`, what the agent already
        took in, an already-consumed message it has not taken in is its own, from an earlier ack of its own
        whose answer was lost: the stream or the mesh went away after the mesh recorded it)."""
        mine = addressed_to(agent_id, messages)
        if not mine:
            return []
        return won(mine, await self.ack(agent_id, [m.sequence for m in mine], turn), taken)

    async def consume_many(self, messages: Mapping[str, list[envelope_pb2.Envelope]],
                           turns: Mapping[str, int] | None = None,
                           taken: Mapping[str, set[tuple[str, str]]] | None = None) -> ConsumedMany:
        """`consume` for many agents in one ack request ({agent_id: its messages}, each agent's turn in
        `turns`, what each already took in in `taken`): per agent the messages its ack won, and the
        agents whose ack was refused (nothing of those recorded; the others are). An agent that `taken` does
        not name is acked as `consume` without `taken` (an ALREADY_CONSUMED message is not its own): name
        every agent whose lost ack may have consumed something, with an empty set for one that took in
        nothing yet (a defaultdict's default does not count: `get` does not make it)."""
        mine = {agent_id: addressed_to(agent_id, batch) for agent_id, batch in messages.items()}
        mine = {agent_id: batch for agent_id, batch in mine.items() if batch}
        done = ConsumedMany()
        if not mine:
            return done
        answers = await self.ack_many({a: [m.sequence for m in batch] for a, batch in mine.items()}, turns)
        for agent_id, batch in mine.items():
            answer = answers[agent_id]
            if isinstance(answer, errors.MeshError):
                done.refused[agent_id] = answer
                continue
            done.messages[agent_id] = won(batch, answer, taken.get(agent_id) if taken is not None else None)
        return done

    # -- agents coming and going ----------------------------------------------------
    async def attach(self, handles: Iterable[AgentHandle]) -> None:
        """Deliver for these agents on this stream too, from their oldest unconsumed message; returns once
        the mesh announced each (ATTACHED). They are part of every later resubscription; an attach made
        while the stream is reconnecting rides on the next subscription. Raises the refusal (a bad
        credential, a closed agent, the stream full or ending: nothing of the attach was done), or
        Unavailable when the stream ended before the answer."""
        self._check_going()
        new = [h for h in handles if h.agent_id not in self.agents]
        if not new:
            return
        loop = asyncio.get_running_loop()
        waits = []
        for handle in new:
            self.agents[handle.agent_id] = handle
            waits.append(self._attaching.setdefault(handle.agent_id, loop.create_future()))
        request_id = self._answers.next_id()
        self._requests[request_id] = [h.agent_id for h in new]
        try:
            with contextlib.suppress(errors.Unavailable):  # not connected: the next subscription carries them
                await self._write_stream(inbox_pb2.ConsumeRequest(attach=inbox_pb2.AttachRequest(
                    credentials=[h.credential for h in new], max_in_flight=self.max_in_flight,
                    request_id=request_id)))
            await self._answered(asyncio.gather(*waits), "attach")
        finally:
            self._requests.pop(request_id, None)

    async def detach(self, agent_ids: Iterable[str]) -> None:
        """Stop delivering for these agents on this stream (their unacked messages go to their next
        subscriber; acks for them are still answered here); returns once the mesh confirmed it. When no
        agent is left the stream ends, as when its last agent is closed."""
        self._check_going()
        named = [a for a in dict.fromkeys(agent_ids) if a in self.agents]
        if not named:
            return
        for agent_id in named:
            del self.agents[agent_id]
        call = self._call
        loop = asyncio.get_running_loop()
        waits = [self._detaching.setdefault(a, loop.create_future()) for a in named]
        request_id = self._answers.next_id()
        self._requests[request_id] = named
        try:
            try:
                await self._write_stream(inbox_pb2.ConsumeRequest(detach=inbox_pb2.DetachRequest(
                    agent_ids=named, request_id=request_id)))
            except errors.Unavailable:  # not connected: they are not part of the next subscription
                for agent_id in named:
                    future = self._detaching.pop(agent_id, None)
                    if future is not None and not future.done():
                        future.cancel()
                return
            finally:
                if call is not None:
                    self._half_close_if_empty(call)
            await self._answered(asyncio.gather(*waits), "detach")
        finally:
            self._requests.pop(request_id, None)

    async def _answered(self, waiting: Awaitable[T], what: str) -> T:
        """What the mesh answered to a request written on the stream; DeadlineExceeded (NO_ANSWER) when no
        answer came within ack_timeout while the stream stayed up (a stream lost fails it as Unavailable)."""
        try:
            return await asyncio.wait_for(waiting, self.ack_timeout)
        except TimeoutError:
            raise errors.DeadlineExceeded(
                f"no answer to the {what} within {self.ack_timeout:g}s on a live inbox stream: its outcome is"
                f" unknown; {what} again (an ack that had consumed a message reads ALREADY_CONSUMED then)",
                reason=Reason.NO_ANSWER) from None

    async def _write_stream(self, request: inbox_pb2.ConsumeRequest, what: str = "write") -> None:
        """Write a request on the stream; Unavailable when it is not connected, or the call is lost or over
        (ended, half-closed)."""
        try:
            await self._write(request)
        except grpc.aio.AioRpcError as exc:
            raise errors.Unavailable(f"could not {what} on the inbox stream: {exc.details()}",
                                     reason=Reason.STREAM_LOST) from None
        except CALL_ENDED as exc:  # (an AioRpcError is taken by the clause above)
            if own_cancel(exc):
                raise
            # (CancelledError: the call was cancelled, by the stream's end or stop(), while this wrote)
            raise errors.Unavailable(f"could not {what} on the inbox stream: {exc or type(exc).__name__}",
                                     reason=Reason.STREAM_LOST) from None
