"""One inbox stream for all the agents of a host (a few past `agents_per_stream`), each agent's runner
reading its own part of it.

The host's `InboxHub` holds the InboxStream (inboxmesh.client.stream) and hands every agent an
`AgentInbox`: the runner's `Inbox` (agent_host/ports.py). Iterating an AgentInbox attaches the agent to
the shared stream (the first agent opens it with its subscribe, later ones are attached on the open
stream); its items are that agent's deliveries and subscription events only, ATTACHED first, again
after each reconnect (the stream resubscribes everything attached by itself), CLOSED or SUPERSEDED
last. `consume` acks the agent's own messages with its own turn; `stop` detaches the agent.

Work the agents ask for within one pass of the event loop goes to the mesh together: the attaches of
agents created or resumed together in one `attach` request (or in the subscribe of a new stream), the
acks of runners at their turn boundaries in one `consume_many` (each runner still gets its own
answer: its won messages, or its own refusal), the detaches of inboxes stopped together in one
`detach`. An agent the host knows was closed is not detached: the mesh ends its delivery itself
(CLOSED), and the stream ends once none is left.

When its last agent leaves, the mesh ends a stream; the next agent opens a new one. An agent whose
attach was overtaken by the end of its stream (or refused because the stream was ending or full)
attaches on the next stream; one whose attach was refused for itself (closed meanwhile) fails alone.

Bounds: an agent's items wait in its AgentInbox until its runner takes them (its reader does at once,
moving them to the runner's pending). The mesh never has more than `max_in_flight` of an agent's
messages delivered and unacked, and a delivery repeated after a reconnect is one of those (kept once:
a message whose sequence is already waiting is not queued again), so an AgentInbox holds at most
`max_in_flight` messages, plus at most one ATTACHED (a later one while it waits adds nothing) and the
last event.
Overflow: beyond that bound the mesh broke its own; the excess is dropped and logged (it is unacked,
so it is not lost: the mesh delivers it again on the agent's next subscription), never queued.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from inboxmesh.client import errors
from inboxmesh.client.errors import Reason
from inboxmesh.client.mesh import AgentHandle
from inboxmesh.client.stream import InboxStream, StreamItem
from inboxmesh.common.v1 import envelope_pb2 as env_pb
from inboxmesh.inbox.v1 import inbox_pb2

__all__ = ["AgentInbox", "InboxHub"]
log = logging.getLogger(__name__)
MESH_DEFAULT_IN_FLIGHT = 256
"""The mesh's default max_in_flight (docs/delivery-contract.md, Bounds); asked for explicitly when the
host sets none, so that the bound of every AgentInbox is known."""
PER_ATTACH = 10_000
"""The most credentials one attach may name (docs/delivery-contract.md, Bounds)."""
_GONE = (inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED, inbox_pb2.SUBSCRIPTION_EVENT_KIND_SUPERSEDED,
         inbox_pb2.SUBSCRIPTION_EVENT_KIND_DETACHED)
_ATTACHED = inbox_pb2.SUBSCRIPTION_EVENT_KIND_ATTACHED
_TRY_ANOTHER_STREAM = (Reason.STREAM_ENDING, Reason.STREAM_FULL)


class AgentInbox:
    """One agent's part of the host's inbox stream (the runner's Inbox, agent_host/ports.py)."""

    def __init__(self, hub: InboxHub, handle: AgentHandle, bound: int):
        self.hub = hub
        self.handle = handle
        self.bound = bound
        """The most messages waiting here (max_in_flight)."""
        self.stream: InboxStream | None = None
        """The shared stream the agent is attached (or being attached) on."""
        self.attached = False
        """ATTACHED came on `stream`: the agent is delivered for there."""
        self.ended = False
        self.closed_in_mesh = False
        """The agent was closed: the mesh ends its delivery itself (CLOSED), so a stop detaches nothing."""
        self.dropped = 0
        """Messages dropped because the bound was exceeded (the mesh broke max_in_flight)."""
        self._items: collections.deque[StreamItem] = collections.deque()
        self._waiting_sequences: set[int] = set()
        self._held = 0
        self._failure: errors.MeshError | None = None
        self._changed = asyncio.Event()
        self._iterated = False

    @property
    def agent_id(self) -> str:
        return self.handle.agent_id

    @property
    def held(self) -> int:
        """Messages waiting here for the runner to take them (at most `bound`)."""
        return self._held

    @property
    def reconnects(self) -> int:
        """Times the stream carrying this agent lost its call and subscribed again."""
        return self.stream.reconnects if self.stream is not None else 0

    def __repr__(self) -> str:
        return f"AgentInbox({self.agent_id})"

    # -- the Inbox port -------------------------------------------------------------------
    async def __aiter__(self) -> AsyncGenerator[StreamItem, None]:
        if self._iterated:
            raise RuntimeError(f"{self}: an agent's inbox has one reader")
        self._iterated = True
        if not self.ended:
            self.hub._attach_soon(self)
        announced = False
        while True:
            while not self._items and not self.ended:
                self._changed.clear()
                await self._changed.wait()
            if not self._items:
                if self._failure is not None:
                    raise self._failure
                return
            item = self._taken(self._items.popleft())
            event = item.agent_event
            if event is not None and not announced:
                if event.kind == inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED:
                    # closed before its subscription took: what subscribing a closed agent answers
                    raise errors.FailedPrecondition(f"agent {self.agent_id} is closed; its inbox delivers nothing"
                                                    f" ({event.detail})", reason=Reason.AGENT_CLOSED,
                                                    metadata={"agent_id": self.agent_id})
                announced = event.kind == _ATTACHED
            yield item

    async def consume(self, agent_id: str, messages: list[env_pb.Envelope], turn: int = 0,
                      taken: set[tuple[str, str]] | None = None) -> list[env_pb.Envelope]:
        """Ack the agent's messages for `turn` (InboxStream.consume), with the acks of other agents made
        in the same pass of the event loop. Unavailable when the stream is lost or not attached yet."""
        return await self.hub._consume(self, agent_id, messages, turn, taken)

    def stop(self) -> None:
        """End this inbox here: its iteration ends, and the agent is detached from the stream (what was
        delivered to it and not acked goes to its next subscriber)."""
        self.hub._leave(self)

    # -- what the hub hands over -------------------------------------------------------------
    def _put(self, item: StreamItem) -> None:
        if item.agent_event is not None:
            if item.agent_event.kind == _ATTACHED and any(
                    q.agent_event is not None and q.agent_event.kind == _ATTACHED for q in self._items):
                # the runner reads all that waits in one go, so the ATTACHED waiting reaches it after this
                # reconnect too and tells it the same (and a first ATTACHED stays first)
                return
            self._items.append(item)
            self._changed.set()
            return
        fresh = [m for m in item.messages if m.sequence not in self._waiting_sequences]
        room = self.bound - self._held
        if len(fresh) > room:
            excess = len(fresh) - max(room, 0)
            self.dropped += excess
            log.error("%s: %d message(s) beyond max_in_flight (%d) dropped; the mesh delivers them again on the"
                      " agent's next subscription", self, excess, self.bound)
            fresh = fresh[:max(room, 0)]
        if not fresh:
            return
        self._held += len(fresh)
        self._waiting_sequences.update(m.sequence for m in fresh)
        last = self._items[-1] if self._items else None
        if last is not None and last.agent_event is None:
            last.messages.extend(fresh)  # one item for everything waiting: the runner takes it in one go
        else:
            self._items.append(StreamItem(messages=fresh))
        self._changed.set()

    def _taken(self, item: StreamItem) -> StreamItem:
        if item.messages:
            self._held -= len(item.messages)
            self._waiting_sequences.difference_update(m.sequence for m in item.messages)
        return item

    def _end(self, failure: errors.MeshError | None = None, *, drop: bool = False) -> None:
        """Nothing more comes: the iteration ends after what is waiting (at once with `drop`), raising
        `failure` if there is one."""
        self.ended = True
        self._failure = failure
        if drop:
            self._items.clear()
            self._waiting_sequences.clear()
            self._held = 0
        self._changed.set()


@dataclass
class _Ack:
    messages: list[env_pb.Envelope]
    turn: int
    taken: set[tuple[str, str]] | None
    answer: asyncio.Future[list[env_pb.Envelope]]


class InboxHub:
    """The host's inbox stream(s) and the agents on them. `inbox_of(handle)` gives an agent's
    AgentInbox; `close()` ends everything (safe to call twice)."""

    def __init__(self, *, max_in_flight: int = 0, agents_per_stream: int = PER_ATTACH,
                 min_backoff: float = 0.05, max_backoff: float = 2.0, ack_timeout: float = 30.0):
        self.max_in_flight = max_in_flight or MESH_DEFAULT_IN_FLIGHT
        self.agents_per_stream = agents_per_stream
        self._stream_options: dict[str, Any] = {"min_backoff": min_backoff, "max_backoff": max_backoff,
                                                "ack_timeout": ack_timeout}
        self.streams_opened = 0
        self._inboxes: dict[str, AgentInbox] = {}
        """Agents attached or attaching, by id (an agent leaves it when its inbox ends)."""
        self._current: InboxStream | None = None
        """The stream new agents are attached on."""
        self._pumps: dict[InboxStream, asyncio.Task[None]] = {}
        """Every open stream and the task that reads it and hands its items over."""
        self._to_attach: list[AgentInbox] = []
        self._to_detach: dict[InboxStream, list[str]] = {}
        self._acks: dict[InboxStream, dict[str, _Ack]] = {}
        self._flush: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        """close() is coming: inboxes stopping now are not detached one by one (the streams' end lets go of
        all their agents at once)."""
        self._closed = False

    @property
    def streams(self) -> list[InboxStream]:
        """The streams open now."""
        return list(self._pumps)

    def inbox_of(self, handle: AgentHandle) -> AgentInbox:
        """The agent's AgentInbox; iterating it attaches the agent."""
        if handle.agent_id in self._inboxes:
            raise ValueError(f"agent {handle.agent_id} already has an inbox on this host")
        return AgentInbox(self, handle, self.max_in_flight)

    def closed_in_mesh(self, agent_ids: Iterable[str]) -> None:
        """These agents were closed in the mesh: the mesh ends their delivery on the stream (CLOSED) by
        itself, so their inboxes stopping detaches nothing (a detach racing that end would take its place)."""
        for agent_id in agent_ids:
            inbox = self._inboxes.get(agent_id)
            if inbox is not None:
                inbox.closed_in_mesh = True

    def closing(self) -> None:
        """The host is stopping: its inboxes stop next, then close() ends the streams; no agent is detached
        on its own meanwhile."""
        self._closing = True

    async def close(self) -> None:
        """Stop every stream (the mesh releases their agents when the calls end) and end every inbox."""
        if self._closed:
            return
        self._closed = self._closing = True
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        closed = errors.Unavailable("the host's inbox stream was closed", reason=Reason.STREAM_LOST)
        for batch in self._acks.values():
            for ack in batch.values():
                if not ack.answer.done():
                    ack.answer.set_exception(closed)
        self._acks.clear()
        for stream in list(self._pumps):
            stream.stop()
        tasks = [*self._pumps.values(), *self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for inbox in [*self._inboxes.values(), *self._to_attach]:
            inbox._end(drop=True)
        self._inboxes.clear()
        self._to_attach.clear()

    # -- what the inboxes ask -----------------------------------------------------------------
    def _attach_soon(self, inbox: AgentInbox) -> None:
        if self._closed:
            inbox._end(errors.Unavailable("the host's inbox stream was closed", reason=Reason.STREAM_LOST))
            return
        if inbox.agent_id in self._inboxes:
            raise ValueError(f"agent {inbox.agent_id} already has an inbox on this host")
        self._inboxes[inbox.agent_id] = inbox
        self._to_attach.append(inbox)
        self._flush_soon()

    def _leave(self, inbox: AgentInbox) -> None:
        if self._inboxes.get(inbox.agent_id) is inbox:
            del self._inboxes[inbox.agent_id]
            if inbox in self._to_attach:
                self._to_attach.remove(inbox)
            elif (inbox.stream is not None and inbox.stream in self._pumps and not inbox.ended
                  and not inbox.closed_in_mesh and not self._closing):
                self._to_detach.setdefault(inbox.stream, []).append(inbox.agent_id)
                self._flush_soon()
        inbox._end(drop=True)

    async def _consume(self, inbox: AgentInbox, agent_id: str, messages: list[env_pb.Envelope], turn: int,
                       taken: set[tuple[str, str]] | None) -> list[env_pb.Envelope]:
        stream = inbox.stream
        if inbox.ended:  # closed or superseded here: its messages are not this host's to take any more
            raise errors.Unavailable(f"the inbox of {inbox.agent_id} on this host has ended", reason=Reason.STREAM_LOST)
        if stream is None or stream not in self._pumps:
            raise errors.Unavailable(f"the inbox stream of {inbox.agent_id} is not connected",
                                     reason=Reason.STREAM_LOST)
        batch = self._acks.setdefault(stream, {})
        if agent_id in batch:  # a second ack of the agent's in this pass: on its own
            return await stream.consume(agent_id, messages, turn, taken)
        answer: asyncio.Future[list[env_pb.Envelope]] = asyncio.get_running_loop().create_future()
        batch[agent_id] = _Ack(messages, turn, taken, answer)
        self._flush_soon()
        return await answer

    # -- one pass of the event loop's requests, together ----------------------------------------
    def _flush_soon(self) -> None:
        if self._flush is None and not self._closed:
            self._flush = asyncio.get_running_loop().call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush = None
        attaching = [i for i in self._to_attach if not i.ended]
        self._to_attach = []
        if attaching:
            self._place(attaching)
        detaching, self._to_detach = self._to_detach, {}
        for stream, agent_ids in detaching.items():
            self._spawn(self._detach(stream, agent_ids))
        acks, self._acks = self._acks, {}
        for stream, batch in acks.items():
            self._spawn(self._send_acks(stream, batch))

    def _place(self, attaching: list[AgentInbox]) -> None:
        """Put these inboxes on the current stream (one attach per PER_ATTACH) or on new streams."""
        stream = self._current
        if stream is not None and (stream not in self._pumps or not stream.agents):
            stream = None  # over, or ending: its last agent left
        carried = len(stream.agents) if stream is not None else 0
        while attaching:
            if stream is None or carried >= self.agents_per_stream:
                batch, attaching = attaching[:self.agents_per_stream], attaching[self.agents_per_stream:]
                stream = self._open(batch)
                carried = len(batch)
                continue
            take = min(self.agents_per_stream - carried, PER_ATTACH)
            batch, attaching = attaching[:take], attaching[take:]
            carried += len(batch)
            for inbox in batch:
                inbox.stream = stream
            self._spawn(self._attach(stream, batch))

    def _open(self, inboxes: list[AgentInbox]) -> InboxStream:
        stream = InboxStream([i.handle for i in inboxes], max_in_flight=self.max_in_flight, **self._stream_options)
        for inbox in inboxes:
            inbox.stream = stream
        self._current = stream
        self.streams_opened += 1
        self._pumps[stream] = asyncio.get_running_loop().create_task(self._pump(stream), name="host-inbox-stream")
        log.info("inbox stream %d opened for %d agent(s)", self.streams_opened, len(inboxes))
        return stream

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("host inbox stream task failed", exc_info=task.exception())

    # -- talking to the mesh --------------------------------------------------------------------
    async def _attach(self, stream: InboxStream, inboxes: list[AgentInbox]) -> None:
        try:
            await stream.attach([i.handle for i in inboxes])
        except errors.DeadlineExceeded:  # NO_ANSWER: they stay on the stream; a reconnect subscribes them,
            # and they hear ATTACHED then
            log.warning("attach of %d agent(s) not answered within the ack timeout; they wait for the next"
                        " subscription of their stream", len(inboxes))
        except errors.MeshError as exc:
            waiting = [i for i in inboxes if i.stream is stream and not i.attached and not i.ended]
            if isinstance(exc, errors.Unavailable) or exc.reason in _TRY_ANOTHER_STREAM:
                if self._current is stream:
                    self._current = None
                self._again(waiting)  # nothing of it was done here: on another stream
                return
            # all or nothing: the one refused for itself fails alone, the others attach again
            named = [i for i in waiting if i.agent_id == exc.metadata.get("agent_id")]
            if len(waiting) < 2:
                for inbox in waiting:
                    self._refused(inbox, exc)
            elif named:
                self._refused(named[0], exc)
                self._spawn(self._attach(stream, [i for i in waiting if i is not named[0]]))
            else:  # the refusal does not say whose: each on its own
                for inbox in waiting:
                    self._spawn(self._attach(stream, [inbox]))

    def _again(self, inboxes: list[AgentInbox]) -> None:
        for inbox in inboxes:
            inbox.stream = None
            self._to_attach.append(inbox)
        if inboxes:
            self._flush_soon()

    def _refused(self, inbox: AgentInbox, failure: errors.MeshError) -> None:
        if self._inboxes.get(inbox.agent_id) is inbox:
            del self._inboxes[inbox.agent_id]
        inbox._end(failure)

    async def _detach(self, stream: InboxStream, agent_ids: list[str]) -> None:
        try:
            await stream.detach(agent_ids)
        except errors.MeshError as exc:  # the stream is over, or will end, or no answer came: the mesh lets go then
            log.info("detach of %d agent(s) not confirmed: %r", len(agent_ids), exc)

    async def _send_acks(self, stream: InboxStream, batch: dict[str, _Ack]) -> None:
        """One consume_many for the acks of one pass; each waiting consume gets its own agent's answer."""
        live = {agent_id: ack for agent_id, ack in batch.items() if not ack.answer.done()}  # not cancelled
        if not live:
            return
        try:
            done = await stream.consume_many({a: ack.messages for a, ack in live.items()},
                                             turns={a: ack.turn for a, ack in live.items()},
                                             taken={a: ack.taken for a, ack in live.items() if ack.taken is not None})
        except asyncio.CancelledError:  # the hub is closing
            _fail(live.values(), errors.Unavailable("the host's inbox stream was closed", reason=Reason.STREAM_LOST))
            raise
        except Exception as exc:  # lost (Unavailable), unanswered (DeadlineExceeded), a bug: each waiting ack says so
            _fail(live.values(), exc)
            return
        for agent_id, ack in live.items():
            if ack.answer.done():
                continue
            refusal = done.refused.get(agent_id)
            if refusal is not None:
                ack.answer.set_exception(refusal)
            else:
                ack.answer.set_result(done.messages.get(agent_id, []))

    async def _pump(self, stream: InboxStream) -> None:
        """Read one stream and hand every item to the inbox of its agent."""
        failure: errors.MeshError | None = None
        try:
            async for item in stream:
                self._hand_over(stream, item)
        except errors.MeshError as exc:
            log.error("inbox stream of %d agent(s) failed: %s", len(stream.agents), exc)
            failure = exc
        except Exception as exc:  # a bug here must reach the agents' runners, not end their delivery silently
            log.exception("inbox stream reader failed")
            failure = errors.Unavailable(f"the host's inbox stream failed: {exc!r}", reason=Reason.STREAM_LOST)
        finally:
            self._stream_over(stream, failure)

    def _hand_over(self, stream: InboxStream, item: StreamItem) -> None:
        event = item.agent_event
        if event is not None:
            inbox = self._inboxes.get(event.agent_id)
            if inbox is None or inbox.stream is not stream:
                return  # an agent that left, or moved on to another stream
            if event.kind == _ATTACHED:
                inbox.attached = True
            inbox._put(item)
            if event.kind in _GONE:
                del self._inboxes[event.agent_id]
                inbox._end()
            return
        by_agent: dict[str, list[env_pb.Envelope]] = {}
        for message in item.messages:
            by_agent.setdefault(message.recipient, []).append(message)
        for agent_id, messages in by_agent.items():
            inbox = self._inboxes.get(agent_id)
            if inbox is not None and inbox.stream is stream:
                inbox._put(StreamItem(messages=messages))
            # else: it left; the messages are unacked and go to its next subscriber

    def _stream_over(self, stream: InboxStream, failure: errors.MeshError | None) -> None:
        """The stream's iteration ended: its agents hear of a failure; agents not yet attached on a stream
        that ended cleanly (it ran out of agents as they came) attach on the next one."""
        self._pumps.pop(stream, None)
        if self._current is stream:
            self._current = None
        if failure is not None and failure.reason == Reason.AGENT_CLOSED:
            # the stream's one agent was closed while it was away (InboxStream raises that on a stream of one
            # agent): for that agent it is the end of its delivery, as on a stream of several
            closed = self._inboxes.get(failure.metadata.get("agent_id", ""))
            if closed is not None and closed.stream is stream and closed.attached:
                closed._put(StreamItem(agent_event=inbox_pb2.SubscriptionEvent(
                    agent_id=closed.agent_id, kind=inbox_pb2.SUBSCRIPTION_EVENT_KIND_CLOSED, detail=failure.message)))
                del self._inboxes[closed.agent_id]
                closed._end()
        on_it = [i for i in self._inboxes.values() if i.stream is stream]
        if failure is None and not self._closed:
            self._again([i for i in on_it if not i.attached])
            on_it = [i for i in on_it if i.attached]
        for inbox in on_it:
            del self._inboxes[inbox.agent_id]
            inbox._end(failure)


def _fail(acks: Iterable[_Ack], failure: BaseException) -> None:
    for ack in acks:
        if not ack.answer.done():
            ack.answer.set_exception(failure)
